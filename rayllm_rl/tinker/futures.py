"""Futures as Tinker's clients return them: every call returns at once; `.result(timeout)` blocks, `await` works in
async code. A client's calls run on its own ordered lane (`Lane`): one worker thread runs them in the order they
were submitted, as Tinker's server runs a training client's requests in `seq_id` order."""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class APIFuture(Generic[T]):
    """The result of one call (Tinker's `APIFuture` shape): `result(timeout=None)`, `await`, `done()`,
    `exception()`. Every call under it has a bound of its own (the job's `trainer.call_timeout_s`), so a
    `result()` without a timeout still returns or raises."""

    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[["APIFuture[T]"], Any]) -> None:
        self._future.add_done_callback(lambda _: fn(self))

    def future(self) -> concurrent.futures.Future:
        """The underlying `concurrent.futures.Future` (Tinker's `.future()`)."""
        return self._future

    async def result_async(self, timeout: float | None = None) -> T:
        return await asyncio.wait_for(asyncio.wrap_future(self._future), timeout)

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()


class Lane:
    """Runs submitted calls in submission order on worker threads (`workers` 1: strictly one after the other; more:
    started in order, run side by side, as samples are). `close` lets the calls already submitted finish."""

    def __init__(self, name: str, workers: int = 1):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self.name = name

    def submit(self, fn: Callable[..., T], *args: Any) -> APIFuture[T]:
        return APIFuture(self._pool.submit(fn, *args))  # the pool's queue keeps the submission order

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
