"""The Ray backend: actor shells, the job's cluster of actors, GPU placement, the replica router,
dashboard metrics and tool-service actors. Within orchestration/, only this package uses Ray.
"""
