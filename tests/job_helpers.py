"""Running a job's loop on what a test set up (its own Ray, or none): `driver.train` of the config's plan."""
from __future__ import annotations

from rayllm_rl.orchestration import driver
from rayllm_rl.job.plan import make_plan


def run_job(cfg, inputs=None, **kwargs) -> dict:
    """The driver's loop over `make_plan(cfg, inputs)` (the config resolved or not); returns the summary.
    Unlike `rayllm_rl.train` it neither starts nor stops Ray."""
    return driver.train(make_plan(cfg, inputs), inputs, **kwargs)
