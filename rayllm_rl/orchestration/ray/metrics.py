"""Driver metrics exported through `ray.util.metrics` (visible in the Ray dashboard / Prometheus)."""
from __future__ import annotations

import json

from ray.util.metrics import Gauge

_GAUGES = {
    "reward": "Mean reward of the last training batch",
    "tokens_per_s": "Generated tokens per second (collector)",
    "policy_version": "Learner policy version",
    "staleness_mean": "Mean version lag of trained tokens",
    "staleness_max": "Max version lag of trained tokens",
    "sync_seconds": "Seconds of the last weight sync",
    "buffer_depth": "Episodes waiting in the replay buffer",
    "mismatch_abs_logp_diff": "Mean |rollout - learner logprob| of the last step's trained tokens",
    "mismatch_k3": "k3 estimate of KL(rollout || learner) on the last step's trained tokens",
    "mismatch_ratio_max": "Largest learner/rollout probability ratio of the last step's trained tokens",
    "mismatch_frac_outside": "Share of the last step's trained tokens with a ratio outside [0.5, 2]",
}
"""Prometheus names: Ray exports a `ray.util.metrics` metric as `ray_<name>`, so `ray_rayllm_rl_reward`, ...
(launch/grafana/rayllm_rl.json draws one panel per key)."""


class RayMetrics:
    """One Gauge per key, prefixed `rayllm_rl_`."""

    def __init__(self):
        self.gauges = {k: Gauge(f"rayllm_rl_{k}", description=d) for k, d in _GAUGES.items()}

    def update(self, record: dict) -> None:
        for k, g in self.gauges.items():
            if k in record and record[k] is not None:
                g.set(float(record[k]))


def grafana_dashboard() -> dict:
    """A Grafana dashboard with one time-series panel per gauge, over Ray's Prometheus export (the
    datasource is a variable, so it imports into Ray's own Grafana or any other). Shipped as
    launch/grafana/rayllm_rl.json; docs/ray-orchestration.md says how to load it."""
    panels = [{"id": i + 1, "type": "timeseries", "title": k, "description": d,
               "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
               "datasource": {"type": "prometheus", "uid": "${datasource}"},
               "targets": [{"refId": "A", "expr": f'ray_rayllm_rl_{k}{{SessionName=~"$SessionName"}}',
                            "legendFormat": "{{SessionName}}"}]}
              for i, (k, d) in enumerate(_GAUGES.items())]
    variables = [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
                 {"name": "SessionName", "type": "query", "label": "Ray session", "includeAll": True, "multi": True,
                  "datasource": {"type": "prometheus", "uid": "${datasource}"},
                  "query": {"query": "label_values(ray_rayllm_rl_policy_version, SessionName)", "refId": "V"},
                  "definition": "label_values(ray_rayllm_rl_policy_version, SessionName)", "refresh": 2}]
    return {"uid": "rayllm-rl-job", "title": "rayllm_rl job", "tags": ["rayllm_rl", "ray"], "timezone": "browser",
            "schemaVersion": 39, "version": 1, "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
            "templating": {"list": variables}, "panels": panels}


if __name__ == "__main__":  # python -m rayllm_rl.orchestration.ray.metrics > launch/grafana/rayllm_rl.json
    print(json.dumps(grafana_dashboard(), indent=1))
