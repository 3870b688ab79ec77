"""Local Ray sessions for test fixtures: held while they live (the leak guard's view), and shut down, their temp
dir removed, whatever happens, also when starting one fails."""
from __future__ import annotations

import contextlib
import shutil
import tempfile

import leak_guard

JOB_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
"""The environment a test's local Ray gives its workers: one thread each on a 2-core machine, as a job's actors."""


def with_actor_env(init_kwargs: dict) -> dict:
    """`ray.init` arguments whose runtime env also carries the actors' environment (`ACTOR_ENV_VARS`), as the
    local Ray a job starts has it: the job's actors then start in its own workers (`JobEnvActorClass`)."""
    from rayllm_rl.orchestration.ray.actors import ACTOR_ENV_VARS

    runtime_env = dict(init_kwargs.get("runtime_env") or {})
    runtime_env["env_vars"] = {**ACTOR_ENV_VARS, **(runtime_env.get("env_vars") or {})}
    return {**init_kwargs, "runtime_env": runtime_env}


@contextlib.contextmanager
def local_ray_session(owner: str, actor_env: bool = True, **init_kwargs):
    """A local Ray for a fixture (`ray.init(address="local", ...)`, no dashboard, its own temp dir): held while
    it lives, and shut down, its temp dir removed, whatever happens (also when starting it fails). `actor_env`:
    its runtime env carries the actors' environment, as a job's own Ray does (False: a Ray as a user starts it)."""
    import ray

    temp = tempfile.mkdtemp(prefix="/tmp/rt-")
    kwargs = {"address": "local", "include_dashboard": False, "_temp_dir": temp, **init_kwargs}
    with leak_guard.holding_ray(owner):
        try:
            ray.init(**(with_actor_env(kwargs) if actor_env else kwargs))
            yield
        finally:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)
