"""What `rayllm-rl serve` remembers of its training runs and checkpoints, in one JSON file under `--state-dir`.

The SDK asks the server things our TinkerService does not record: a run's base model and LoRA rank
(`GET training_runs/{id}`, `POST weights_info`, and create-via-`load_weights`, which "derives the lora_config from
the checkpoint"), a run's checkpoints (`GET training_runs/{id}/checkpoints`), deleting one. The registry keeps
them, and outlives the server: a new server on the same state directory resumes a run saved by an earlier one.
Written whole to a temporary file and renamed over the old one, so a reader never sees half a file.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
from pathlib import Path

from tinker import types

FILE = "registry.json"


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat()


def parse_path(path: str) -> types.ParsedCheckpointTinkerPath:
    """`tinker://RUN/weights|sampler_weights/NAME` parsed as the SDK parses it; ValueError naming the path."""
    try:
        return types.ParsedCheckpointTinkerPath.from_tinker_path(path)
    except ValueError:
        raise ValueError(f"{path!r} is not a checkpoint path (tinker://RUN_ID/weights/NAME or "
                         "tinker://RUN_ID/sampler_weights/NAME)") from None


class Registry:
    """Runs by training run id and checkpoints by tinker path, as dicts in the shape of the SDK's
    `TrainingRun` and `Checkpoint` types."""

    def __init__(self, state_dir: str | Path):
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.file = self.dir / FILE
        self._data = self._read()

    def _read(self) -> dict:
        if not self.file.exists():
            return {"version": 1, "runs": {}, "checkpoints": {}}
        try:
            data = json.loads(self.file.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"the server's registry {self.file} cannot be read ({error}); move it away to "
                             "start with an empty one") from None
        if not isinstance(data, dict) or data.get("version") != 1:
            raise ValueError(f"{self.file} is not a rayllm-rl serve registry (version 1)")
        return data

    def _write(self) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".registry-", dir=self.dir)
        with os.fdopen(fd, "w") as f:
            json.dump(self._data, f, indent=1)
        os.replace(tmp, self.file)

    def add_run(self, run_id: str, *, model_id: str, base_model: str, lora_rank: int,
                user_metadata: dict | None = None) -> None:
        self._data = self._read()
        self._data["runs"][run_id] = {
            "training_run_id": run_id, "model_id": model_id, "base_model": base_model, "model_owner": "local",
            "is_lora": lora_rank > 0, "lora_rank": lora_rank or None, "last_request_time": now_iso(),
            "user_metadata": {str(k): str(v) for k, v in (user_metadata or {}).items()} or None}
        self._write()

    def run(self, run_or_model_id: str) -> dict | None:
        """A run by its training run id, or by the model id the SDK knows it under."""
        runs = self._data["runs"]
        if run_or_model_id in runs:
            return runs[run_or_model_id]
        return next((r for r in runs.values() if r["model_id"] == run_or_model_id), None)

    def add_checkpoint(self, path: str, *, user_metadata: dict | None = None, ttl_seconds: int | None = None) -> dict:
        parsed = parse_path(path)
        self._data = self._read()
        created = dt.datetime.now(dt.timezone.utc)
        entry = {"checkpoint_id": parsed.checkpoint_id, "checkpoint_type": parsed.checkpoint_type,
                 "time": created.isoformat(), "tinker_path": path, "training_run_id": parsed.training_run_id,
                 "user_metadata": {str(k): str(v) for k, v in (user_metadata or {}).items()} or None,
                 "expires_at": (created + dt.timedelta(seconds=ttl_seconds)).isoformat() if ttl_seconds else None}
        self._data["checkpoints"][path] = entry
        if parsed.training_run_id in self._data["runs"]:
            self._data["runs"][parsed.training_run_id]["last_request_time"] = entry["time"]
        self._write()
        return entry

    def checkpoint(self, path: str) -> dict | None:
        return self._data["checkpoints"].get(path)

    def checkpoints(self, run_id: str) -> list[dict]:
        return [c for c in self._data["checkpoints"].values()
                if c["training_run_id"] == run_id and not c.get("deleted")]

    def delete(self, run_id: str, checkpoint_id: str) -> dict | None:
        """Forget a checkpoint (kept as deleted, so a later use of its path says so); None if unknown."""
        self._data = self._read()
        for entry in self._data["checkpoints"].values():
            if entry["training_run_id"] == run_id and entry["checkpoint_id"] == checkpoint_id \
                    and not entry.get("deleted"):
                entry["deleted"] = now_iso()
                self._write()
                return entry
        return None

    def check_usable(self, path: str) -> dict | None:
        """The entry of a checkpoint path about to be loaded or sampled; ValueError if it was deleted."""
        entry = self.checkpoint(path)
        if entry is not None and entry.get("deleted"):
            raise ValueError(f"checkpoint {path} was deleted (at {entry['deleted']})")
        return entry

    def training_run(self, run: dict) -> dict:
        """A run as the SDK's `TrainingRun` JSON: with its newest training and sampler checkpoints."""
        mine = self.checkpoints(run["training_run_id"])
        last = {kind: max((c for c in mine if c["checkpoint_type"] == kind), key=lambda c: c["time"], default=None)
                for kind in ("training", "sampler")}
        return {k: v for k, v in run.items() if k != "model_id"} | {
            "last_checkpoint": _public(last["training"]), "last_sampler_checkpoint": _public(last["sampler"])}


def _public(entry: dict | None) -> dict | None:
    """A checkpoint entry as the SDK's `Checkpoint` JSON (without our bookkeeping keys)."""
    if entry is None:
        return None
    return {k: entry[k] for k in ("checkpoint_id", "checkpoint_type", "time", "tinker_path", "user_metadata",
                                  "expires_at")}


def public_checkpoint(entry: dict) -> dict:
    return _public(entry)  # type: ignore[return-value]
