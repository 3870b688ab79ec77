"""Shared tool services as Ray actors: one sandbox pool serves every env worker."""
from __future__ import annotations

import asyncio
import functools
from typing import Any

import ray


@ray.remote(num_cpus=0)
class PythonExecutorService:
    """`python-executor` on the dashboard: runs sandboxed code for many env workers at once.

    At most `max_parallel` sandboxes run at a time (the rest queue), so many workers cannot
    oversubscribe the node's cores; each run is a `PythonSandbox` process with its own limits.
    """

    def __init__(self, max_parallel: int = 4, **sandbox_kwargs: Any):
        from rayllm_rl.tools.sandbox import PythonSandbox

        self.sandbox = PythonSandbox(**sandbox_kwargs)
        self.slots = asyncio.Semaphore(max_parallel)
        self.runs = 0

    async def run(self, code: str, timeout: float = 10.0, stdin: str = "", files: dict | None = None):
        async with self.slots:
            self.runs += 1
            return await self.sandbox.arun(code, timeout=timeout, stdin=stdin, files=files)

    def stats(self) -> dict[str, int]:
        return {"runs": self.runs}


def python_executor_service(name: str = "python-executor", max_parallel: int = 4, **sandbox_kwargs: Any):
    """The named service actor, created on first use and shared afterwards (get_if_exists)."""
    return PythonExecutorService.options(name=name, get_if_exists=True, max_concurrency=1000).remote(
        max_parallel, **sandbox_kwargs)


class RemoteExecutor:
    """`run(code, timeout=...)` over a PythonExecutorService handle, for sync callers such as
    PythonInterpreter; waits at most the run's timeout plus `grace_s` (queueing included)."""

    def __init__(self, handle, grace_s: float = 60.0):
        self.handle = handle
        self.grace_s = grace_s

    def run(self, code: str, timeout: float = 10.0, **kwargs: Any):
        return ray.get(self.handle.run.remote(code, timeout, **kwargs), timeout=timeout + self.grace_s)


@functools.lru_cache(maxsize=4)
def _shared_executor_service(cluster: str):
    """The `python-executor` actor handle, looked up once per worker process and cluster (`gcs_address`)."""
    return python_executor_service()


def ray_python_tools() -> list:
    """Per-episode tools of the python_tool workflow in an env worker: a PythonInterpreter over the shared
    `python-executor` service actor. The Ray backend hands this to `factories.build_workflow`."""
    from rayllm_rl.tools.python_interpreter import PythonInterpreter

    service = _shared_executor_service(ray.get_runtime_context().gcs_address)
    return [PythonInterpreter(RemoteExecutor(service), done_when_no_code=True)]
