"""Environments as tasks: `task=openenv`, an OpenEnv `Environment` (in process, or a running server through
OpenEnv's client) or a TRL `environment_factory` class, and `task=verifiers`, a verifiers (classic API) environment,
played token-in/token-out in the env workers. Which task plays an environment object is decided here, once
(`environment_task`); an OpenEnv form once (`source.resolve_source`); each OpenEnv episode is a session
(`openenv_session`, `trl_session`) driven by `workflow.EnvWorkflow`, each verifiers one a rollout of its own through
our proxy (`verifiers_workflow`). docs/environments.md."""
from __future__ import annotations

from typing import Any


def environment_task(environment: Any) -> str:
    """The task that plays an environment object given in Python (`train(environment=...)`): `verifiers` for a
    verifiers Environment instance, else `openenv` (an OpenEnv Environment subclass or a TRL class)."""
    from rayllm_rl.environments.verifiers_env import is_verifiers_environment
    from rayllm_rl.envs.task_registry import OPENENV_TASK, VERIFIERS_TASK

    return VERIFIERS_TASK if is_verifiers_environment(environment) else OPENENV_TASK
