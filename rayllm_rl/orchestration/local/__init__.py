"""The local backend: every role of a job in the driver's process, no Ray."""
