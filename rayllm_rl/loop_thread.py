"""An asyncio event loop in a daemon thread, for synchronous callers of objects that live on a
loop: the single-process backend's engine, collector and buffer, and the MCP client sessions."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")


class EventLoopThread:
    """`call` runs a coroutine on the loop and waits, bounded; `close` winds the loop down."""

    def __init__(self, name: str):
        self.name = name
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()
        self._closed = False

    def call(self, coro: Awaitable[T], timeout_s: float, what: str) -> T:
        """Run `coro` on the loop and return its result. After `timeout_s` it is cancelled and a
        TimeoutError names `what`; a TimeoutError the coroutine raises itself passes unchanged."""
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self.name}: the loop is closed, cannot run {what}")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            if fut.done():
                raise  # the coroutine's own error, with its own message
            fut.cancel()
            raise TimeoutError(f"{self.name}: {what} did not finish within {timeout_s:g}s") from None

    def run(self, fn: Callable[..., T], *args: Any, timeout_s: float = 60.0) -> T:
        """Call a plain function on the loop's thread (for objects that own asyncio primitives)."""
        async def on_loop():
            return fn(*args)
        return self.call(on_loop(), timeout_s, getattr(fn, "__name__", "call"))

    def close(self, first: Awaitable[Any] | None = None, timeout_s: float = 30.0) -> None:
        """Await `first` (an owner's shutdown coroutine) if given, cancel every task left, stop the
        loop and join the thread. Idempotent; raises if the wind-down outlasts `timeout_s`."""
        if self._closed:
            if first is not None:
                first.close()
            return

        async def wind_down():
            try:
                if first is not None:
                    await first
            finally:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        try:
            self.call(wind_down(), timeout_s, "shutting down")
        finally:
            self._closed = True
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout_s)
            if not self.thread.is_alive():
                self.loop.close()
