"""The Ray session of a job: `ray.init` (join the job's cluster, or start a local Ray with token auth and its
dashboard on 127.0.0.1), the one dashboard line the job prints, and the shutdown of a Ray the job started."""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import ray

from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.orchestration.ray.actors import ACTOR_ENV_VARS


LOCAL_SYSTEM_CONFIG = {"free_objects_period_milliseconds": 0}
"""Ray settings of a local Ray this package starts. Ray frees an object nobody references in batches,
once a second by default; a weight version published meanwhile lands in memory the store has never
given out, and the first touch of each page costs the publish ~100 ms for 101.5 MB (30,000 page faults
against none, measured here). Freed at once, versions reuse the same memory. A cluster you start
yourself takes it from the environment: `RAY_free_objects_period_milliseconds=0 ray start ...`."""


DASHBOARD_HOST = "127.0.0.1"
"""Where a local Ray's dashboard listens: this machine only (from elsewhere, an SSH tunnel); Ray's token auth
guards it as it guards the rest of the cluster."""


def local_init_kwargs(cfg: GRPOJobConfig, **extra: Any) -> dict[str, Any]:
    """The `ray.init` arguments of the local Ray a job starts (`extra`, e.g. `num_cpus`, added). Its runtime env
    carries `ACTOR_ENV_VARS`, so the actors start in the job's own workers (`JobEnvActorClass`)."""
    runtime_env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(cfg.ray.threads_per_actor),
                                **ACTOR_ENV_VARS}}
    return {"address": "local", "_temp_dir": cfg.ray.temp_dir or None, "include_dashboard": cfg.ray.dashboard,
            "dashboard_host": DASHBOARD_HOST, "runtime_env": runtime_env, "log_to_driver": True,
            "_system_config": LOCAL_SYSTEM_CONFIG, **extra}


def init_ray(cfg: GRPOJobConfig, **local_extra: Any) -> None:
    """Join RAY_ADDRESS / cfg.ray.address, or start a local Ray (token auth stays on; its dashboard on
    127.0.0.1 unless `ray.dashboard=false`; `local_extra`: more `ray.init` arguments for it); then print the
    dashboard's URL, once, to stdout."""
    if ray.is_initialized():
        return
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
    with _ray_url_line_dropped():
        if address:  # e.g. under `ray job submit`: keep the job's own runtime env (working_dir)
            context = ray.init(address=address, log_to_driver=True)
        else:
            context = ray.init(**local_init_kwargs(cfg, **local_extra))
    line = dashboard_line(context.dashboard_url)
    if line:
        print(line, flush=True)


def dashboard_line(url: str | None) -> str | None:
    """What a job prints about the dashboard of the Ray it started or joined: its URL and how to pass
    Ray's token auth; None without a dashboard."""
    if not url:
        return None
    url = url if "://" in url else f"http://{url}"
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":  # ray.init sets it when it turns token auth on
        return f"Ray dashboard: {url} (token auth off)"
    if os.environ.get("RAY_AUTH_TOKEN"):
        where = "the value of $RAY_AUTH_TOKEN"
    else:
        where = f"the token in {os.environ.get('RAY_AUTH_TOKEN_PATH') or '~/.ray/auth_token'}"
    return f"Ray dashboard: {url} (token auth on: the page asks for {where}; `ray get-auth-token` prints it)"


class _DropDashboardUrl(logging.Filter):
    """Takes " View the dashboard at <url>" off Ray's "Started a local Ray instance." / "Connected to Ray
    cluster." line: the job prints the URL itself, with how to pass the token, and only once."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and " View the dashboard at" in record.msg:
            record.msg, record.args = record.msg.split(" View the dashboard at")[0], ()
        return True


@contextlib.contextmanager
def _ray_url_line_dropped():
    logger, dropper = logging.getLogger("ray._private.worker"), _DropDashboardUrl()
    logger.addFilter(dropper)
    try:
        yield
    finally:
        logger.removeFilter(dropper)


@contextlib.contextmanager
def session_for_job():
    """Around a Ray job run by `train`: a local Ray the run starts is shut down at the end (which flushes
    the actors' logs before the caller prints the summary); a Ray already initialised is left running."""
    started_here = not ray.is_initialized()
    try:
        yield
    finally:
        if started_here:
            ray.shutdown()
