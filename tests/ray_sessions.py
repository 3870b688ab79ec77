"""Local Ray sessions for test fixtures: held while they live (the leak guard's view), and shut down, their temp
dir removed, whatever happens, also when starting one fails."""
from __future__ import annotations

import contextlib
import shutil
import tempfile

import leak_guard

JOB_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
"""The environment a test's local Ray gives its workers: one thread each on a 2-core machine, as a job's actors."""


@contextlib.contextmanager
def local_ray_session(owner: str, **init_kwargs):
    """A local Ray for a fixture (`ray.init(address="local", ...)`, no dashboard, its own temp dir): held while
    it lives, and shut down, its temp dir removed, whatever happens (also when starting it fails)."""
    import ray

    temp = tempfile.mkdtemp(prefix="/tmp/rt-")
    with leak_guard.holding_ray(owner):
        try:
            ray.init(**{"address": "local", "include_dashboard": False, "_temp_dir": temp, **init_kwargs})
            yield
        finally:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)
