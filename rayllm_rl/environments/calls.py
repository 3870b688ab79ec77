"""Every call into an environment, bounded and classified: what a failed episode's cause is.

An environment's reset, step or tool call runs under `call_timeout_s`: a coroutine (an async twin, a remote
client) is awaited with `asyncio.wait_for`; a sync method runs in a worker thread awaited the same way (a thread
cannot be killed: past its bound the sample fails and the thread finishes on its own). What it raises reaches
`guard_sample` (data/failures.py) and becomes the sample's cause by `cause_of`: `TimeoutError` -> `timeout`, a
`ConnectionError` -> `server_lost`, anything else -> `raised`. A remote server's lost WebSocket
(`websockets.ConnectionClosed`) or refused connection (`OSError`) is re-raised here as `EnvServerLost`, a
`ConnectionError`, so that it reads as `server_lost` and not as the environment's own error.
"""
from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable


class EnvServerLost(ConnectionError):
    """The environment's server went away (its connection closed or was refused): cause `server_lost`."""


class EnvCallTimeout(TimeoutError):
    """An environment call ran past its bound: cause `timeout`."""


def _lost_connection(exc: BaseException) -> bool:
    """A closed WebSocket (by class name: the `websockets` package is the remote client's, not ours) or an OS-level
    connection error."""
    names = {t.__name__ for t in type(exc).__mro__}
    return bool(names & {"ConnectionClosed", "ConnectionClosedError", "InvalidURI", "InvalidHandshake"}) or (
        isinstance(exc, OSError) and not isinstance(exc, TimeoutError))


async def bounded(what: str, fn: Callable[..., Any], *args: Any, timeout_s: float, remote: bool = False,
                  **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` within `timeout_s`: awaited when `fn` is a coroutine function or `remote` (OpenEnv's
    `EnvClient` returns an awaitable when called inside a running loop), else run in a worker thread (and its
    result awaited if it is awaitable). `what` names the call in errors ("step of CalcEnv"). `remote`: the call
    crosses a connection, whose loss is `EnvServerLost`."""
    try:
        if inspect.iscoroutinefunction(fn) or remote:  # a remote client answers with an awaitable in a running loop
            return await asyncio.wait_for(_await(fn(*args, **kwargs)), timeout_s)
        result = await asyncio.wait_for(asyncio.to_thread(fn, *args, **kwargs), timeout_s)
        if inspect.isawaitable(result):  # a client whose sync-looking method hands back an awaitable
            return await asyncio.wait_for(_await(result), timeout_s)
        return result
    except asyncio.TimeoutError:
        raise EnvCallTimeout(f"{what} ran past data.openenv.call_timeout_s={timeout_s:g}s") from None
    except Exception as exc:
        if remote and _lost_connection(exc) and not isinstance(exc, EnvServerLost):
            raise EnvServerLost(f"{what}: the environment's server is gone ({type(exc).__name__}: {exc})") from exc
        raise


async def _await(result: Any) -> Any:
    """`result` awaited if it is awaitable (as a coroutine, which `asyncio.wait_for` takes), else itself."""
    return await result if inspect.isawaitable(result) else result
