"""Faults a job's start runs into, injected into Ray's workers (a fake only to reach a failure path).

`install` is a Ray `worker_process_setup_hook`: every worker of the test's Ray session runs it when it starts.
It wraps two methods of the product; each wrapper reads the fault file named by `$RAYLLM_START_FAULT_FILE` when
it is called (a worker started before the test chose a fault still obeys it) and, when the file names its
fault, fails the way a real start fails:

* ``engine_never_ready``: an inference replica's engine never finishes starting (as vLLM on a loaded machine);
* ``receiver_fails``: a replica's shm receiver fails after learner rank 0 made its segments.
"""
from __future__ import annotations

import asyncio
import os

FAULT_FILE_VAR = "RAYLLM_START_FAULT_FILE"


def active_fault() -> str:
    path = os.environ.get(FAULT_FILE_VAR)
    try:
        with open(path) as f:
            return f.read().strip()
    except (TypeError, OSError):
        return ""


def install() -> None:
    """Wrap the two methods when their modules are first imported (importing them here would slow every
    worker's start, which Ray runs only a few at a time)."""
    import sys

    sys.meta_path.insert(0, _PatchOnImport({"rayllm_rl.inference.transformers.engine": _patch_engine,
                                            "rayllm_rl.weight_sync.shm": _patch_shm_receiver}))


class _PatchOnImport:
    """A meta-path finder that runs `patches[name](module)` right after module `name` is executed."""

    def __init__(self, patches):
        self.patches = patches

    def find_spec(self, name, path=None, target=None):
        import importlib.machinery

        if name not in self.patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            exec_module, patch = spec.loader.exec_module, self.patches[name]

            def exec_and_patch(module):
                exec_module(module)
                patch(module)

            spec.loader.exec_module = exec_and_patch
        return spec


def _patch_engine(module) -> None:
    start = module.TransformersEngine.start

    async def start_or_hang(self, *args, **kwargs):
        if active_fault() == "engine_never_ready":
            await asyncio.sleep(3600)
        return await start(self, *args, **kwargs)

    module.TransformersEngine.start = start_or_hang


def _patch_shm_receiver(module) -> None:
    receiver_init = module.ShmWeightReceiver.__init__

    def receiver_init_or_fail(self, *args, **kwargs):
        if active_fault() == "receiver_fails":
            raise RuntimeError("injected fault: this replica's shm receiver failed after the segments were made")
        receiver_init(self, *args, **kwargs)

    module.ShmWeightReceiver.__init__ = receiver_init_or_fail
