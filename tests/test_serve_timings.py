"""`rayllm-rl serve`'s timings (rayllm_rl/tinker/server/timings.py): the union of overlapping service calls, the
long poll's wait kept out of a request's handling time, and the app's `GET /api/v1/rayllm/timings` keyed by route
templates (not by the ids in paths), with a service call timed through `State.call`. No model: a stand-in service."""
from __future__ import annotations

import asyncio

from starlette.testclient import TestClient

from rayllm_rl.tinker.server.app import make_app
from rayllm_rl.tinker.server.timings import Timings

KEY = {"X-API-Key": "tml-test"}


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_busy_time_is_the_union_of_overlapping_calls_and_sums_stay_per_call():
    clock = _Clock()
    t = Timings(clock)
    a = t.in_service("sample")
    b = t.in_service("sample")
    c = t.in_service("optim_step")
    a.__enter__()                 # sample a: 0 .. 3
    clock.now = 1.0
    b.__enter__()                 # sample b: 1 .. 4 (overlaps a)
    clock.now = 3.0
    a.__exit__(None, None, None)
    clock.now = 4.0
    b.__exit__(None, None, None)
    clock.now = 6.0
    c.__enter__()                 # optim_step: 6 .. 8, while nothing else runs
    clock.now = 7.0
    mid = t.snapshot()            # an open call counts up to now
    assert mid["service"]["optim_step"]["busy_s"] == 1.0 and mid["service_busy_s"] == 5.0
    clock.now = 8.0
    c.__exit__(None, None, None)
    snap = t.snapshot()
    assert snap["service"]["sample"] == {"count": 2, "sum_s": 6.0, "max_s": 3.0, "busy_s": 4.0}
    assert snap["service"]["optim_step"] == {"count": 1, "sum_s": 2.0, "max_s": 2.0, "busy_s": 2.0}
    assert snap["service_busy_s"] == 6.0  # 0..4 and 6..8
    assert snap["lanes"] == {"sampling": {"busy_s": 4.0}, "training": {"busy_s": 2.0}}


def test_a_call_that_raises_is_still_timed_and_closes_its_interval():
    clock = _Clock()
    t = Timings(clock)
    try:
        with t.in_service("forward_backward"):
            clock.now = 2.5
            raise RuntimeError("the learner died")
    except RuntimeError:
        pass
    clock.now = 10.0
    snap = t.snapshot()
    assert snap["service"]["forward_backward"]["busy_s"] == 2.5 and snap["service_busy_s"] == 2.5


def test_handling_time_is_wall_time_less_the_long_polls_wait():
    t = Timings(_Clock())
    t.request("POST /api/v1/retrieve_future", 20.0)
    t.request("POST /api/v1/retrieve_future", 1.5)
    t.wait("POST /api/v1/retrieve_future", 19.9)
    t.wait("POST /api/v1/retrieve_future", 1.4)
    t.request("POST /api/v1/asample", 0.25)
    with t.coding("encode sample"):
        pass
    snap = t.snapshot()
    poll = snap["endpoints"]["POST /api/v1/retrieve_future"]
    assert poll["count"] == 2 and poll["total_s"] == 21.5 and poll["max_s"] == 20.0
    assert abs(poll["wait_s"] - 21.3) < 1e-9 and abs(poll["handling_s"] - 0.2) < 1e-9
    assert snap["endpoints"]["POST /api/v1/asample"]["handling_s"] == 0.25
    assert abs(snap["handling_s"] - 0.45) < 1e-9
    assert snap["codec"]["encode sample"]["count"] == 1


class _Service:
    """What the handshake endpoints read of a TinkerService."""

    base_model = "stand-in"


def test_the_app_serves_its_timings_by_route_template(tmp_path):
    app = make_app(_Service(), state_dir=tmp_path)
    with TestClient(app) as client:
        assert client.post("/api/v1/telemetry", json={}, headers=KEY).status_code == 200
        for session in ("sess-a", "sess-b"):  # two ids, one route
            assert client.post(f"/api/v1/sessions/{session}/finish", json={}, headers=KEY).status_code == 404
        assert client.post("/api/v1/no_such_endpoint", json={}, headers=KEY).status_code == 404
        assert client.post("/api/v1/retrieve_future", json={"request_id": "req-x"}, headers=KEY).status_code == 404
        state = app.app.app.state.tinker  # _Gate -> TimingMiddleware -> Starlette

        async def one_call():
            return await state.call("create_training_client", lambda: "made")
        assert asyncio.run(one_call()) == "made"
        assert client.get("/api/v1/rayllm/timings").status_code == 401  # behind the API key like the rest
        snap = client.get("/api/v1/rayllm/timings", headers=KEY).json()
    endpoints = snap["endpoints"]
    assert endpoints["POST /api/v1/telemetry"]["count"] == 1
    assert endpoints["POST /api/v1/sessions/{session_id}/finish"]["count"] == 2
    assert endpoints["POST (unmatched)"]["count"] == 1
    assert endpoints["POST /api/v1/retrieve_future"]["count"] == 1
    assert snap["service"]["create_training_client"]["count"] == 1
    assert snap["service_busy_s"] >= 0 and snap["uptime_s"] > 0
    assert all(row["handling_s"] >= 0 for row in endpoints.values())
