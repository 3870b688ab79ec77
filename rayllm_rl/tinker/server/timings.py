"""Where `rayllm-rl serve`'s time goes: its HTTP handling and encoding against the time inside the service.

A Tinker client's step is HTTP requests (JSON or protobuf in, a future's `request_id` out, then long polls of
`retrieve_future`); the work behind them is the service's (our TrainingClient on the learner, our SamplingClient on
the engine's replicas). To tell the two apart the server keeps, accumulated since it started:

* `endpoints`: per route (`POST /api/v1/asample`, ...): requests, wall seconds from the request's arrival to its
  response's last byte, and the most one took. A `retrieve_future` long poll is mostly waiting for the result,
  so its wait is kept apart (`waits`) and `handling_s` is the wall time less it: parsing, routing and encoding.
* `service`: per kind of service call (`forward_backward`, `optim_step`, `sample`, ...): calls, the seconds each
  finished call was outstanding summed (`sum_s`; concurrent samples overlap), and `busy_s`, the wall seconds
  during which at least one call of that kind was outstanding (the engine's or the learner's occupied time as the
  server sees it). A call starts being timed when the server awaits it, which for a training call can be while
  the calls before it still run (the SDK sends `optim_step` right behind `forward_backward`, and our
  TrainingClient runs them one at a time), so a kind's `busy_s` can include waiting behind the others. `lanes`
  unions the kinds the way the service runs them: `sampling` (`sample`: the engine), `training` (every other
  kind: the learner, and the weight sync of `save_weights_and_get_sampling_client`); `service_busy_s` unions all.
* `codec`: seconds spent decoding request bodies and encoding results (protobuf), per kind.

`GET /api/v1/rayllm/timings` (app.py) serves `snapshot()` as JSON. Everything runs on the server's one event loop
(service calls are awaited there), so no lock is needed; the clock is `time.perf_counter`.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any


class _Stat:
    """count, total seconds and the largest single one."""

    __slots__ = ("count", "total_s", "max_s")

    def __init__(self):
        self.count, self.total_s, self.max_s = 0, 0.0, 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)

    def as_dict(self) -> dict:
        return {"count": self.count, "total_s": round(self.total_s, 6), "max_s": round(self.max_s, 6)}


class _Busy:
    """The wall seconds during which at least one interval was open (the union of overlapping intervals)."""

    __slots__ = ("active", "since", "busy_s")

    def __init__(self):
        self.active, self.since, self.busy_s = 0, 0.0, 0.0

    def open(self, now: float) -> None:
        if self.active == 0:
            self.since = now
        self.active += 1

    def close(self, now: float) -> None:
        self.active -= 1
        if self.active == 0:
            self.busy_s += now - self.since

    def total(self, now: float) -> float:
        """Busy seconds so far, an interval still open counted up to `now`."""
        return self.busy_s + (now - self.since if self.active else 0.0)


SAMPLING_KINDS = frozenset({"sample"})
"""Service calls that run on the service's sampling lane (side by side); every other kind is the training lane's."""


class Timings:
    """The server's accumulated timings (module docstring). `clock` is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.started = clock()
        self.endpoints: dict[str, _Stat] = {}
        self.waits: dict[str, _Stat] = {}
        self.codec: dict[str, _Stat] = {}
        self.service: dict[str, _Stat] = {}
        self._busy: dict[str, _Busy] = {}
        self._lanes = {"training": _Busy(), "sampling": _Busy()}
        self._any = _Busy()

    def request(self, endpoint: str, seconds: float) -> None:
        """One request of `endpoint` ("METHOD /route") took `seconds`, arrival to response."""
        self.endpoints.setdefault(endpoint, _Stat()).add(seconds)

    def wait(self, endpoint: str, seconds: float) -> None:
        """`seconds` of a request of `endpoint` were spent waiting (a long poll), not handling it."""
        self.waits.setdefault(endpoint, _Stat()).add(seconds)

    @contextlib.contextmanager
    def coding(self, kind: str) -> Iterator[None]:
        """Time a decode or encode of `kind` (e.g. `encode sample`)."""
        t0 = self.clock()
        try:
            yield
        finally:
            self.codec.setdefault(kind, _Stat()).add(self.clock() - t0)

    @contextlib.contextmanager
    def in_service(self, kind: str) -> Iterator[None]:
        """Time a call into the service of `kind`, from its start to its result (or failure)."""
        unions = (self._busy.setdefault(kind, _Busy()),
                  self._lanes["sampling" if kind in SAMPLING_KINDS else "training"], self._any)
        t0 = self.clock()
        for busy in unions:
            busy.open(t0)
        try:
            yield
        finally:
            t1 = self.clock()
            for busy in unions:
                busy.close(t1)
            self.service.setdefault(kind, _Stat()).add(t1 - t0)

    def snapshot(self) -> dict[str, Any]:
        """Everything so far as JSON-ready dicts (module docstring for the fields)."""
        now = self.clock()
        endpoints = {}
        for name, stat in sorted(self.endpoints.items()):
            row = stat.as_dict()
            waited = self.waits[name].total_s if name in self.waits else 0.0
            row.update(wait_s=round(waited, 6), handling_s=round(stat.total_s - waited, 6))
            endpoints[name] = row
        service = {}
        for kind, busy in sorted(self._busy.items()):  # a kind whose first call is still open: count 0
            stat = self.service.get(kind) or _Stat()
            service[kind] = {"count": stat.count, "sum_s": round(stat.total_s, 6), "max_s": round(stat.max_s, 6),
                             "busy_s": round(busy.total(now), 6)}
        handling = sum(row["handling_s"] for row in endpoints.values())
        return {"uptime_s": round(now - self.started, 3), "endpoints": endpoints, "service": service,
                "lanes": {lane: {"busy_s": round(busy.total(now), 6)} for lane, busy in self._lanes.items()},
                "service_busy_s": round(self._any.total(now), 6),
                "codec": {kind: stat.as_dict() for kind, stat in sorted(self.codec.items())},
                "handling_s": round(handling, 6)}


class TimingMiddleware:
    """ASGI middleware: each HTTP request's wall time, arrival to the end of the inner app's response, under its
    route's template (`scope["route"]`, which Starlette's router sets on the shared scope) so ids in paths do not
    make a key each; a request no route matched counts under "METHOD (unmatched)"."""

    def __init__(self, app, timings: Timings):
        self.app = app
        self.timings = timings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = self.timings.clock()
        try:
            await self.app(scope, receive, send)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None)
            if path is None or path == "/{path:path}":
                path = "(unmatched)"
            self.timings.request(f"{scope.get('method')} {path}", self.timings.clock() - t0)
