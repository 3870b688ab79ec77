"""The environment every actor of a job runs with, in a module that imports nothing, so that a launcher
(`jobs/submit_local.py`) can put it in a submitted job's runtime env without importing Ray or torch: a job whose
runtime env carries it starts its actors in the job's own workers (`actors.JobEnvActorClass`)."""
from __future__ import annotations

import json

ACTOR_ENV_VARS = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC": "0",
                  "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}
"""Environment of every actor process, merged with the job's: HF_HUB_DISABLE_PROGRESS_BARS turns off
huggingface_hub's and transformers' progress bars (checkpoint "Writing model shards", "Loading
weights"), which Ray would forward to the driver's console under its progress bar.
RAY_WARN_BLOCKING_GET_INSIDE_ASYNC=0: a replica fetches weights with `ray.get` on a worker thread
(`asyncio.to_thread`), which does not block its event loop; Ray warns about any `ray.get` in an
async actor's process all the same.
RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1: an actor given no GPU gets CUDA_VISIBLE_DEVICES="" (Ray 2.60 leaves it
unset, ray-project/ray#54868), so a CPU replica, learner or reference on a GPU node cannot pick up GPU 0 by
itself (the engines and the reference choose CUDA when torch sees a GPU)."""


def runtime_env_json() -> str:
    """`ray job submit --runtime-env-json` giving the job's actors their environment."""
    return json.dumps({"env_vars": ACTOR_ENV_VARS})
