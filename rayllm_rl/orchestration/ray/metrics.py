"""Driver metrics exported through `ray.util.metrics` (visible in the Ray dashboard / Prometheus)."""
from __future__ import annotations

from ray.util.metrics import Gauge

_GAUGES = {
    "reward": "Mean reward of the last training batch",
    "tokens_per_s": "Generated tokens per second (collector)",
    "policy_version": "Learner policy version",
    "staleness_mean": "Mean version lag of trained tokens",
    "staleness_max": "Max version lag of trained tokens",
    "sync_seconds": "Seconds of the last weight sync",
    "buffer_depth": "Episodes waiting in the replay buffer",
}


class RayMetrics:
    """One Gauge per key, prefixed `rayllm_rl_`."""

    def __init__(self):
        self.gauges = {k: Gauge(f"rayllm_rl_{k}", description=d) for k, d in _GAUGES.items()}

    def update(self, record: dict) -> None:
        for k, g in self.gauges.items():
            if k in record and record[k] is not None:
                g.set(float(record[k]))
