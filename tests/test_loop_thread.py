"""EventLoopThread: bounded calls onto a loop in a thread, and a clean wind-down."""
from __future__ import annotations

import asyncio

import pytest

from rayllm_rl.loop_thread import EventLoopThread


def test_a_slow_call_is_cancelled_and_named_but_the_coroutines_own_timeout_passes_unchanged():
    runner = EventLoopThread("test-loop")
    cancelled = asyncio.Event()

    async def slow():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def own_timeout():
        raise TimeoutError("replay buffer: fewer than 4 episodes")

    try:
        assert runner.call(asyncio.sleep(0, result=7), 5, "a quick one") == 7
        assert runner.run(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(TimeoutError, match=r"test-loop: the slow one did not finish within 0.2s"):
            runner.call(slow(), 0.2, "the slow one")
        assert runner.call(asyncio.wait_for(cancelled.wait(), 5), 10, "cancel check") is True
        with pytest.raises(TimeoutError, match="fewer than 4 episodes"):
            runner.call(own_timeout(), 5, "own")
    finally:
        runner.close()


def test_close_awaits_the_owners_shutdown_then_cancels_what_is_left():
    runner = EventLoopThread("test-loop")
    order: list[str] = []

    async def forever():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            order.append("cancelled")
            raise

    async def shutdown():
        order.append("shutdown")

    runner.run(lambda: asyncio.ensure_future(forever()))
    runner.close(shutdown(), timeout_s=10)
    assert order == ["shutdown", "cancelled"] and not runner.thread.is_alive()
    runner.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        runner.call(asyncio.sleep(0), 1, "late")


def test_run_bounded_returns_reraises_and_gives_up_at_its_deadline():
    import threading

    from rayllm_rl.loop_thread import run_bounded

    assert run_bounded(lambda: 42, 1.0, "the quick one") == 42
    with pytest.raises(ValueError, match="boom"):
        run_bounded(lambda: (_ for _ in ()).throw(ValueError("boom")), 1.0, "the failing one")
    release = threading.Event()
    with pytest.raises(TimeoutError, match=r"the stuck one did not return within 0.2s"):
        run_bounded(lambda: release.wait(5), 0.2, "the stuck one")
    release.set()
