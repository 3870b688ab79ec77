"""The server's side of Tinker's futures: every training and sampling endpoint answers at once with a
`request_id`, and the SDK long-polls `/api/v1/retrieve_future` for the outcome (`tinker/lib/api_future_impl.py`).

A `FutureStore` holds each request's outcome until the SDK has had time to read it: pending, a result (JSON, or an
object the server encodes as protobuf when the SDK asks for it), or a failure with the SDK's error category
(`tinker.types.RequestErrorCategory`: `user` for bad input, `server` for a role that failed). `wait` is the long
poll: it returns within its bound (below the SDK's 45 s read timeout) whether or not the request finished.
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

USER_ERRORS = (ValueError, TypeError, KeyError, LookupError)
"""Exceptions that mean the request was wrong (category `user`); anything else is the server's (`server`)."""


@dataclasses.dataclass
class Outcome:
    """A request's state: `done` unset while pending; then `value` (with `encode` for a result the SDK wants as
    protobuf) or `error` and `category`. `extra` is what the side endpoints serve (a sample's extension)."""

    kind: str
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    value: Any = None
    error: str | None = None
    category: str = "unknown"
    finished_at: float | None = None
    extra: dict | None = None


def error_category(error: BaseException) -> str:
    return "user" if isinstance(error, USER_ERRORS) else "server"


def describe(error: BaseException) -> str:
    """`Type: message` of an exception (its message alone can be empty)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


async def settle(value: Any, timeout_s: float, what: str) -> Any:
    """The value of what a service call returned: our `APIFuture` (awaited), a `concurrent.futures.Future`, another
    awaitable, or a plain value; at most `timeout_s` seconds, then TimeoutError naming `what`."""
    if inspect.isawaitable(value):
        async def _await():
            return await value

        waiting: Awaitable = _await()
    elif hasattr(value, "result") and hasattr(value, "done"):
        waiting = asyncio.to_thread(value.result, timeout_s)
    else:
        return value
    try:
        return await asyncio.wait_for(waiting, timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"{what} did not finish within {timeout_s:g} s") from None


class FutureStore:
    """Outcomes by request id. Finished ones are kept `keep_s` seconds (the SDK reads each once, and again only
    when a read was lost), pending ones until they finish."""

    def __init__(self, keep_s: float = 1800.0):
        self._outcomes: dict[str, Outcome] = {}
        self._tasks: set[asyncio.Task] = set()
        self._keep_s = keep_s

    def new(self, kind: str) -> str:
        """A fresh pending request id."""
        self._prune()
        request_id = f"req-{uuid.uuid4().hex}"
        self._outcomes[request_id] = Outcome(kind=kind)
        return request_id

    def get(self, request_id: str) -> Outcome | None:
        return self._outcomes.get(request_id)

    def resolve(self, request_id: str, value: Any, extra: dict | None = None) -> None:
        outcome = self._outcomes[request_id]
        if outcome.done.is_set():
            return
        outcome.value, outcome.extra, outcome.finished_at = value, extra, time.monotonic()
        outcome.done.set()

    def fail(self, request_id: str, error: BaseException | str, category: str | None = None) -> None:
        outcome = self._outcomes[request_id]
        if outcome.done.is_set():
            return
        if isinstance(error, BaseException):
            category = category or error_category(error)
            if category == "server":
                logger.warning("request %s (%s) failed: %s", request_id, outcome.kind, describe(error),
                               exc_info=error)
            error = describe(error)
        outcome.error, outcome.category, outcome.finished_at = error, category or "server", time.monotonic()
        outcome.done.set()

    def run(self, request_id: str, work: Callable[[], Awaitable[Any]],
            finish: Callable[[Any], tuple[Any, dict | None]] | None = None) -> None:
        """Resolve `request_id` with what `work()` returns (through `finish`, which may also give the side
        endpoints' extra), or fail it with what it raises. Runs as a task of the running loop."""
        async def _run():
            try:
                value = await work()
                self.resolve(request_id, *(finish(value) if finish else (value, None)))
            except Exception as error:  # noqa: BLE001 - every failure becomes the request's outcome
                self.fail(request_id, error)

        task = asyncio.get_running_loop().create_task(_run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self, request_id: str, timeout_s: float) -> Outcome | None:
        """The outcome once finished, or None if it is still pending after `timeout_s` (the long poll's bound);
        KeyError for an id this server never issued or has forgotten."""
        outcome = self._outcomes.get(request_id)
        if outcome is None:
            raise KeyError(request_id)
        try:
            await asyncio.wait_for(outcome.done.wait(), timeout_s)
        except asyncio.TimeoutError:
            return None
        return outcome

    def _prune(self) -> None:
        now = time.monotonic()
        stale = [k for k, o in self._outcomes.items()
                 if o.finished_at is not None and now - o.finished_at > self._keep_s]
        for key in stale:
            del self._outcomes[key]

    async def cancel_all(self, timeout_s: float = 5.0) -> None:
        """Stop the waiting tasks (at shutdown), at most `timeout_s` seconds."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
