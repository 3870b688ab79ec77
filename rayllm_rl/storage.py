"""Where a job's results go: `trainer.run_dir` and a relative `resume=` resolve against one storage root, as Ray
Train's `storage_path` does, and never against a Ray job's temporary copy of its working dir (deleted with the job).

The root, first found: `trainer.storage_root`; the environment variable `RAYLLM_STORAGE_ROOT`; inside a job that
`ray job submit --working-dir` uploaded, `~/rayllm_results` of the node the driver runs on; else the directory the
job was started from (a local `python jobs/grpo.py` keeps writing `runs/grpo/<stamp>` in the checkout). Every
path the job reports is absolute. On several nodes, point the root at storage every node mounts: the learners
write the checkpoints on their own nodes.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

STORAGE_ENV = "RAYLLM_STORAGE_ROOT"
JOB_DEFAULT_ROOT = "~/rayllm_results"
"""The root of a job running in an uploaded working dir (Ray Train's default is `~/ray_results`)."""
RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""What Ray's job supervisor gives the entrypoint: the job's runtime env, `working_dir` among it."""


@dataclasses.dataclass(frozen=True)
class StorageRoot:
    path: Path
    """Absolute."""
    source: str
    """Where it came from, in words (the dry run and the job's last lines say it)."""

    def resolve(self, path: str) -> Path:
        """`path` itself when absolute (`~` expanded), else under the root."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else self.path / p


def check_root(value: str, where: str) -> None:
    """A storage root is absolute (or starts with ~): a relative one would resolve against the working dir again."""
    if value and not Path(value).expanduser().is_absolute():
        raise ValueError(f"{where}={value!r}: a storage root must be an absolute path (or start with ~)")


def in_uploaded_working_dir(cwd: str, environ: dict) -> bool:
    """Whether this process runs in Ray's copy of a `--working-dir` (a job submitted with one): the job
    supervisor's runtime env names a working_dir, or the cwd is under Ray's `runtime_resources/working_dir_files`."""
    raw = environ.get(RAY_JOB_CONFIG_ENV, "")
    try:
        runtime_env = (json.loads(raw) or {}).get("runtime_env") or {} if raw else {}
    except (ValueError, AttributeError):
        runtime_env = {}
    parts = Path(cwd).parts
    under_ray = "runtime_resources" in parts and "working_dir_files" in parts
    return bool(isinstance(runtime_env, dict) and runtime_env.get("working_dir")) or under_ray


def storage_root(configured: str = "", *, cwd: str | None = None, environ: dict | None = None) -> StorageRoot:
    """The job's storage root (module docstring), absolute; ValueError naming the key or variable if relative."""
    environ = os.environ if environ is None else environ
    cwd = os.getcwd() if cwd is None else cwd
    if configured:
        check_root(configured, "trainer.storage_root")
        return StorageRoot(Path(configured).expanduser(), "trainer.storage_root")
    if environ.get(STORAGE_ENV):
        check_root(environ[STORAGE_ENV], f"${STORAGE_ENV}")
        return StorageRoot(Path(environ[STORAGE_ENV]).expanduser(), f"${STORAGE_ENV}")
    if in_uploaded_working_dir(cwd, environ):
        return StorageRoot(Path(JOB_DEFAULT_ROOT).expanduser(),
                           f"{JOB_DEFAULT_ROOT} (this job runs in Ray's temporary copy of its working dir; "
                           f"set trainer.storage_root or ${STORAGE_ENV} to choose)")
    return StorageRoot(Path(cwd), "the directory the job started from")


def with_resolved_paths(cfg, root: StorageRoot | None = None):
    """`cfg` with `trainer.run_dir` and a non-empty `resume` made absolute under the storage root (what
    config.json then records); the root used."""
    root = root or storage_root(cfg.trainer.storage_root)
    trainer = dataclasses.replace(cfg.trainer, run_dir=str(root.resolve(cfg.trainer.run_dir)))
    resume = str(root.resolve(cfg.resume)) if cfg.resume else cfg.resume
    return dataclasses.replace(cfg, trainer=trainer, resume=resume), root


__all__ = ["JOB_DEFAULT_ROOT", "STORAGE_ENV", "StorageRoot", "check_root", "in_uploaded_working_dir",
           "storage_root", "with_resolved_paths"]
