"""The shipped Grafana dashboard draws exactly the job's Ray gauges, under the names Ray exports them."""
from __future__ import annotations

import json
import re
from pathlib import Path

from rayllm_rl.orchestration.ray.metrics import _GAUGES, grafana_dashboard

SHIPPED = Path(__file__).resolve().parents[1] / "launch" / "grafana" / "rayllm_rl.json"


def test_the_shipped_file_is_what_the_gauges_make():
    assert json.loads(SHIPPED.read_text()) == grafana_dashboard(), \
        "regenerate: python -m rayllm_rl.orchestration.ray.metrics > launch/grafana/rayllm_rl.json"


def test_one_panel_per_gauge_with_rays_exported_name_and_no_overlap():
    dash = grafana_dashboard()
    exprs = [p["targets"][0]["expr"] for p in dash["panels"]]
    names = [re.match(r"ray_rayllm_rl_(\w+)\{", e).group(1) for e in exprs]
    assert names == list(_GAUGES) and len(_GAUGES) == 11
    assert {"mismatch_abs_logp_diff", "mismatch_k3", "reward", "policy_version"} <= set(names)
    boxes = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in dash["panels"]}
    assert len(boxes) == len(dash["panels"])  # no two panels drawn on the same spot
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"])
