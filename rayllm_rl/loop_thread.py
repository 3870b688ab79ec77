"""Work on a daemon thread for synchronous callers, always with a deadline: an asyncio event loop for
objects that live on a loop (the single-process backend's engine, collector and buffer, the MCP
client sessions), and `run_bounded` for one blocking call that has no deadline of its own."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")


def run_bounded(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """`fn()` on a daemon thread, waited for at most `timeout_s`; returns its value or re-raises what it
    raised. Past the deadline a TimeoutError names `what`, and the call is abandoned (it runs on in its
    thread): for calls with no deadline of their own (Ray's collective groups, a tracker's close)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the waiting thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"bounded: {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not return within {timeout_s:g}s (abandoned)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


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
