"""Environments as tasks (`task=openenv`): an OpenEnv `Environment` (in process, or a running server through
OpenEnv's client) or a TRL `environment_factory` class, played token-in/token-out in the env workers. The form is
decided once (`source.resolve_source`); each episode is a session (`openenv_session`, `trl_session`) driven by
`workflow.EnvWorkflow`. docs/environments.md."""
