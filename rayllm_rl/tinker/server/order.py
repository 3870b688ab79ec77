"""Requests of one Tinker training client, run in the order of their `seq_id`s.

The SDK numbers every request of a TrainingClient (`seq_id = request_id + 1`, `training_client.py`) and expects the
server to execute them in that order, though it sends them on parallel connections: the chunks of one
`forward_backward` go out together, the first chunk last (`_run_fwd_bwd`: "The server won't process later chunks
until the first one arrives"). `SeqOrder` holds what arrives early until the ones before it have started, then
starts each, in order, on our TrainingClient (whose calls run in submission order).

A seq_id that never arrives (the SDK gave up on it before sending, a body that could not be read) would stall the
model for good; so after `gap_timeout_s` the requests waiting behind the gap fail with an error naming the
missing seq_id, and the order moves on past them. One that turns up after that fails too: its turn is gone.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from rayllm_rl.tinker.server.futures import FutureStore

logger = logging.getLogger(__name__)

RESEND_WINDOW = 1024
"""How many seq_ids back a resent request still gets its first answer's request id."""

Start = Callable[[], Awaitable[Callable[[], Awaitable[object]]]]
"""Starts a request on the client (in order) and returns what waits for its result (run concurrently)."""

Finish = Callable[[object], tuple[object, "dict | None"]]
"""Turns a result into what the store keeps (and the side endpoints' extra)."""


class SeqOrder:
    """The order of one model's requests. `first_seq` is the seq_id of its first ordered request (1: after
    `create_model`, or after a create-via-`load_weights`, which is seq 0 and needs no turn)."""

    def __init__(self, model_id: str, store: FutureStore, *, gap_timeout_s: float, first_seq: int = 1):
        self.model_id = model_id
        self._store = store
        self._gap_timeout_s = gap_timeout_s
        self._next = first_seq
        self._waiting: dict[int, tuple[str, Start, Finish | None]] = {}
        self._issued: dict[int, str] = {}
        self._arrived = asyncio.Event()
        self._ready = asyncio.Event()
        self._ready_error: str | None = None
        self._task: asyncio.Task | None = None

    def set_ready(self, error: str | None = None) -> None:
        """The model exists (or failed to: every request waiting on it then fails with `error`)."""
        self._ready_error = error
        self._ready.set()

    def submit(self, seq_id: int, kind: str, start: Start, finish: Finish | None = None) -> str:
        """The request id of this seq_id's request: a new one queued for its turn, or the one already issued for
        it (the SDK resent a request whose answer it lost). `finish` turns the result into the stored outcome."""
        if seq_id in self._issued:
            return self._issued[seq_id]
        request_id = self._store.new(kind)
        self._issued[seq_id] = request_id
        for old in [s for s in self._issued if s < self._next - RESEND_WINDOW]:
            del self._issued[old]
        if seq_id < self._next:
            self._store.fail(request_id, f"seq_id {seq_id} of model {self.model_id} arrived after its turn "
                             f"(the server is at seq_id {self._next}); it was not executed", "user")
            return request_id
        self._waiting[seq_id] = (request_id, start, finish)
        self._arrived.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drain())
        return request_id

    async def _drain(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            for request_id, _, _ in self._waiting.values():
                self._store.fail(request_id, "the server shut down before this request ran", "server")
            raise

    async def _run(self) -> None:
        while True:
            if not self._ready.is_set():
                await self._ready.wait()  # set by create_model's task, which has its own timeout
            if self._next in self._waiting:
                request_id, start, finish = self._waiting.pop(self._next)
                self._next += 1
                await self._start(request_id, start, finish)
                continue
            self._arrived.clear()
            if not self._waiting:
                await self._arrived.wait()
                continue
            try:
                await asyncio.wait_for(self._arrived.wait(), self._gap_timeout_s)
            except asyncio.TimeoutError:
                self._give_up_on_gap()

    async def _start(self, request_id: str, start: Start, finish: Finish | None) -> None:
        if self._ready_error is not None:
            self._store.fail(request_id, self._ready_error, "user")
            return
        try:
            wait = await start()
        except Exception as error:  # noqa: BLE001 - a request that fails to start is its own failure
            self._store.fail(request_id, error)
            return
        self._store.run(request_id, wait, finish)

    def _give_up_on_gap(self) -> None:
        later = sorted(self._waiting)
        message = (f"seq_id {self._next} of model {self.model_id} never arrived within {self._gap_timeout_s:g} s, "
                   f"so seq_ids {later} queued behind it were not executed; the server moves on to "
                   f"seq_id {later[-1] + 1}")
        logger.warning(message)
        for seq_id in later:
            request_id, _, _ = self._waiting.pop(seq_id)
            self._store.fail(request_id, message, "server")
        self._next = later[-1] + 1

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
