"""MCP tools for ChatEnv: a pool of MCP client sessions and the MCPToolTransform (TorchRL's transform).

`MCPClientPool` connects to MCP servers (stdio subprocesses or streamable-HTTP endpoints) with
real `mcp.ClientSession`s that live on an asyncio loop in a background thread, so synchronous
callers (ChatEnv transforms) can use `call_tool_sync`. `MCPToolTransform` parses the
Qwen/Hermes tool calls of the last assistant message,

    <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>

calls them and appends one `tool_role` message with each result in `<tool_response>...</tool_response>`.
A malformed call, an unknown tool, a tool error or a timeout gives `{"error": "..."}` as that
call's result, never an exception out of the transform.

Sharing: one pool (one server process / HTTP session per server) can serve many transforms and
threads; pass the pool, not configs, to transforms built per episode, and `close()` it when done.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

import torch
from tensordict import TensorDictBase

from rayllm_rl.envs.transforms import Transform
from rayllm_rl.loop_thread import EventLoopThread

__all__ = ["MCPServerConfig", "MCPToolSpec", "MCPClientPool", "MCPToolError", "MCPToolTimeout", "ToolCall",
           "parse_tool_calls", "system_prompt_for_tools", "MCPToolTransform"]

logger = logging.getLogger(__name__)

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_GRACE_S = 2.0  # beyond a call's own timeout, before the sync caller gives up on the loop


class MCPToolError(RuntimeError):
    """A tool call that failed: unknown server/tool, a tool error result, a protocol error."""


class MCPToolTimeout(MCPToolError, TimeoutError):
    """A tool call that exceeded its timeout."""


@dataclass
class MCPServerConfig:
    """One MCP server: `transport="stdio"` runs `command args` (with `env` merged over a safe
    default environment), `transport="http"` connects to a streamable-HTTP `url` (e.g.
    `http://127.0.0.1:8000/mcp`). `timeout_s` is the default per-call timeout; the stdio
    server's stderr goes to `stderr_path` (appended) or is discarded."""

    name: str
    transport: Literal["stdio", "http"] = "stdio"
    command: str | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    cwd: str | None = None
    url: str | None = None
    timeout_s: float = 30.0
    connect_timeout_s: float = 30.0
    stderr_path: str | None = None

    def __post_init__(self) -> None:
        if not self.name or "." in self.name:
            raise ValueError(f"server name must be non-empty and without '.', got {self.name!r}")
        needs = {"stdio": ("command", self.command), "http": ("url", self.url)}.get(self.transport)
        if needs is None:
            raise ValueError(f"transport must be 'stdio' or 'http', got {self.transport!r}")
        if not needs[1]:
            raise ValueError(f"{self.transport} server {self.name!r} needs a {needs[0]}")


@dataclass(frozen=True)
class MCPToolSpec:
    """A tool as the model sees it: `name` is `tool`, or `server.tool` when several servers have it."""

    name: str
    server: str
    tool: str
    description: str
    input_schema: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        """OpenAI/Hermes function format (what `apply_chat_template(tools=...)` accepts)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.input_schema}}


def _describe(exc: BaseException) -> str:
    """`Type: message` of an exception, of the leaf errors of an (anyio) exception group."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


def _result_text(result: Any) -> str:
    """Text of a CallToolResult: its text blocks joined, other blocks summarised."""
    parts = []
    for block in getattr(result, "content", None) or []:
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}: {block.mime_type}]")
        else:
            parts.append(block.model_dump_json(by_alias=True, exclude_none=True))
    if not parts and getattr(result, "structured_content", None) is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


class MCPClientPool:
    """MCP client sessions to `servers`, on an asyncio loop in a daemon thread.

    `connect()` (done by the constructor unless `connect=False`) starts every server, runs the
    MCP handshake and lists the tools; it raises `ConnectionError` if any server fails (and
    shuts the others down). `close()` ends the sessions (stdio servers get their stdin closed,
    then SIGTERM/SIGKILL as the mcp SDK does) and stops the thread. Usable as a context manager.
    """

    def __init__(self, servers: Sequence[MCPServerConfig] | MCPServerConfig, *, connect: bool = True) -> None:
        from rayllm_rl.extras import require

        require("MCP tool servers (MCPClientPool, MCPToolTransform)", "mcp")
        servers = [servers] if isinstance(servers, MCPServerConfig) else list(servers)
        names = [s.name for s in servers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate server names: {names}")
        self.configs: dict[str, MCPServerConfig] = {s.name: s for s in servers}
        self._sessions: dict[str, Any] = {}
        self._server_tools: dict[str, list[Any]] = {}
        self._tasks: list[asyncio.Task] = []
        self._stop: asyncio.Event | None = None
        self._runner: EventLoopThread | None = None
        self._lock = threading.Lock()
        self.tools: dict[str, MCPToolSpec] = {}
        """Exposed name -> spec; `server.tool` always resolves too (see `resolve`)."""
        if connect:
            self.connect()

    # ------------------------------------------------------------------ lifecycle
    def connect(self) -> "MCPClientPool":
        with self._lock:
            if self._runner is not None:
                return self
            self._runner = EventLoopThread("mcp-client-pool")
        limit = max((c.connect_timeout_s for c in self.configs.values()), default=0.0) + 15.0
        try:
            errors = self._submit(self._connect_all(), limit, "connecting")
        except BaseException:
            self.close()
            raise
        if errors:
            self.close()
            raise ConnectionError("could not connect to MCP server(s): " + "; ".join(errors))
        self._index_tools()
        return self

    def close(self) -> None:
        """Shut every session and server down and stop the loop thread (idempotent)."""
        with self._lock:
            runner, self._runner = self._runner, None
        if runner is None:
            return
        try:
            runner.close(self._shutdown(), timeout_s=30.0)
        except Exception as exc:  # noqa: BLE001 - close must not raise
            logger.warning("MCPClientPool: unclean shutdown: %r", exc)
        finally:
            self._sessions.clear()

    __enter__ = connect

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def loop_thread(self) -> threading.Thread | None:
        """The daemon thread the sessions' event loop runs in; None before `connect` (a pool made with
        `connect=False`) and after `close`, which stops the thread."""
        runner = self._runner
        return None if runner is None else runner.thread

    def _submit(self, coro, timeout: float, what: str):
        runner = self._runner
        if runner is None:
            coro.close()
            raise MCPToolError("MCPClientPool is not connected (closed, or connect() not called)")
        return runner.call(coro, timeout, what)

    # ------------------------------------------------------------------ async side (loop thread)
    async def _connect_all(self) -> list[str]:
        self._stop = asyncio.Event()
        readies = {}
        for cfg in self.configs.values():
            ready = asyncio.get_running_loop().create_future()
            readies[cfg.name] = ready
            self._tasks.append(asyncio.create_task(self._serve(cfg, ready), name=f"mcp-{cfg.name}"))
        errors = []
        for name, ready in readies.items():
            try:
                self._server_tools[name] = await ready
            except BaseException as exc:  # noqa: BLE001 - reported to the caller
                errors.append(f"{name}: {_describe(exc)}")
        return errors

    async def _serve(self, cfg: MCPServerConfig, ready: asyncio.Future) -> None:
        """Owns one server's transport + session for its whole life (anyio scopes stay in one task)."""
        import anyio
        from mcp import ClientSession, StdioServerParameters, stdio_client
        from mcp.client.streamable_http import streamable_http_client

        try:
            async with contextlib.AsyncExitStack() as stack:
                if cfg.transport == "stdio":
                    errlog = stack.enter_context(open(cfg.stderr_path or os.devnull, "a"))
                    params = StdioServerParameters(command=cfg.command, args=list(cfg.args), env=cfg.env, cwd=cfg.cwd)
                    read, write = await stack.enter_async_context(stdio_client(params, errlog=errlog))
                else:
                    read, write = await stack.enter_async_context(streamable_http_client(cfg.url))
                session = await stack.enter_async_context(ClientSession(read, write))
                with anyio.fail_after(cfg.connect_timeout_s):
                    await session.initialize()
                    tools = await self._list_all(session)
                self._sessions[cfg.name] = session
                ready.set_result(tools)
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else ConnectionError(repr(exc)))
            elif not isinstance(exc, asyncio.CancelledError):
                logger.warning("MCP server %r: session ended with %r", cfg.name, exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._sessions.pop(cfg.name, None)

    @staticmethod
    async def _list_all(session) -> list[Any]:
        from mcp.types import PaginatedRequestParams

        result = await session.list_tools()
        tools = list(result.tools)
        while result.next_cursor:
            result = await session.list_tools(params=PaginatedRequestParams(cursor=result.next_cursor))
            tools += result.tools
        return tools

    async def _shutdown(self) -> None:
        if self._stop is not None:
            self._stop.set()
        pending = (await asyncio.wait(self._tasks, timeout=20.0))[1] if self._tasks else ()
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5.0)
        self._tasks.clear()

    async def list_tools(self, server: str) -> list[Any]:
        """The server's `mcp.types.Tool`s, fetched again."""
        return await self._list_all(self._session(server))

    async def call_tool(self, server: str, tool: str, arguments: Mapping[str, Any] | None = None,
                        timeout: float | None = None) -> str:
        """Call `tool` on `server`; its text, or MCPToolError (tool error) / MCPToolTimeout."""
        from mcp import MCPError
        from mcp.types import REQUEST_TIMEOUT

        session = self._session(server)
        timeout = float(timeout if timeout is not None else self.configs[server].timeout_s)
        try:
            result = await asyncio.wait_for(
                session.call_tool(tool, dict(arguments or {}), read_timeout_seconds=timeout), timeout + _GRACE_S)
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise MCPToolTimeout(f"tool {tool!r} timed out after {timeout:g}s") from exc
        except MCPError as exc:
            if exc.code == REQUEST_TIMEOUT:
                raise MCPToolTimeout(f"tool {tool!r} timed out after {timeout:g}s") from exc
            raise MCPToolError(f"tool {tool!r} failed: {exc.message}") from exc
        except Exception as exc:  # noqa: BLE001 - closed connection, invalid result, ...
            raise MCPToolError(f"tool {tool!r} failed: {type(exc).__name__}: {exc}") from exc
        text = _result_text(result)
        if result.is_error:
            raise MCPToolError(f"tool {tool!r} failed: {text}")
        return text

    def _session(self, server: str):
        session = self._sessions.get(server)
        if session is None:
            raise MCPToolError(f"MCP server {server!r} is not connected")
        return session

    # ------------------------------------------------------------------ sync API
    def list_tools_sync(self, server: str, timeout: float = 30.0) -> list[Any]:
        return self._submit(self.list_tools(server), timeout, f"listing {server!r}'s tools")

    def call_tool_sync(self, server: str, tool: str, arguments: Mapping[str, Any] | None = None,
                       timeout: float | None = None) -> str:
        """Blocking `call_tool` from any thread but the pool's own."""
        if server not in self.configs:
            raise MCPToolError(f"unknown MCP server {server!r}")
        limit = float(timeout if timeout is not None else self.configs[server].timeout_s)
        try:
            return self._submit(self.call_tool(server, tool, arguments, limit), limit + 2 * _GRACE_S, f"tool {tool!r}")
        except MCPToolTimeout:
            raise
        except TimeoutError as exc:  # the call itself did not return in time
            raise MCPToolTimeout(f"tool {tool!r} timed out after {limit:g}s") from exc

    def _index_tools(self) -> None:
        owners: dict[str, list[str]] = {}
        for server, tools in self._server_tools.items():
            for t in tools:
                owners.setdefault(t.name, []).append(server)
        self.tools = {}
        for server, tools in self._server_tools.items():
            for t in tools:
                name = t.name if len(owners[t.name]) == 1 else f"{server}.{t.name}"
                self.tools[name] = MCPToolSpec(name, server, t.name, t.description or "", dict(t.input_schema))

    def resolve(self, name: str) -> tuple[str, str]:
        """`(server, tool)` for an exposed name or a `server.tool` name; KeyError if unknown."""
        spec = self.tools.get(name)
        if spec is not None:
            return spec.server, spec.tool
        server, _, tool = name.partition(".")
        if tool and any(t.name == tool for t in self._server_tools.get(server, ())):
            return server, tool
        raise KeyError(name)


# ---------------------------------------------------------------------------- tool-call parsing
@dataclass
class ToolCall:
    """One parsed `<tool_call>`; `error` is set (and name may be empty) when it is malformed."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The Qwen/Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` calls of `text`,
    in order; an unterminated last `<tool_call>` counts as a malformed call."""
    text = text or ""
    bodies = TOOL_CALL_RE.findall(text)
    tail = text[text.rfind("</tool_call>") + len("</tool_call>"):] if bodies else text
    if "<tool_call>" in tail:
        bodies.append(None)
    calls = []
    for body in bodies:
        if body is None:
            calls.append(ToolCall("", {}, "malformed tool call: unterminated <tool_call>"))
            continue
        obj: Any = None
        try:
            obj = json.loads(body)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
                raise ValueError('expected {"name": str, "arguments": object}')
            args = obj.get("arguments", obj.get("parameters"))
            if isinstance(args, str):  # OpenAI style: arguments as a JSON string
                args = json.loads(args) if args.strip() else {}
            if args is None:
                args = {}
            if not isinstance(args, dict):
                raise ValueError("'arguments' must be a JSON object")
            calls.append(ToolCall(obj["name"], args))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            name = obj.get("name") if isinstance(obj, dict) else None
            calls.append(ToolCall(name if isinstance(name, str) else "", {}, f"malformed tool call: {exc}"))
    return calls


def system_prompt_for_tools(tools: Sequence[Mapping[str, Any] | MCPToolSpec], preamble: str = "") -> str:
    """Hermes/Qwen2.5-style tool instructions with a `<tools>...</tools>` block, after `preamble`."""
    lines = [json.dumps(t.to_openai() if isinstance(t, MCPToolSpec) else dict(t), ensure_ascii=False) for t in tools]
    block = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + "\n".join(lines)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    return f"{preamble.rstrip()}\n\n{block}" if preamble else block


# ---------------------------------------------------------------------------- transform
class MCPToolTransform(Transform):
    """After each step, runs the tool calls of the last assistant message on MCP servers.

    `pool`: an `MCPClientPool`, or server configs (the transform then owns a pool it creates and
    closes in `close()`). The results go into one `tool_role` message (default "tool"; "user"
    for templates without a tool role), each as `<tool_response>\\n...\\n</tool_response>`
    (`wrap_responses=False` leaves the wrapping to templates that add it themselves, e.g. Qwen2.5's).
    A turn without a tool call adds nothing; with `done_when_no_call=True` it ends the episode
    (done + terminated). `timeout_s` overrides the servers' per-call timeouts; `max_calls`
    caps the calls run per message (the rest get an error and count in `num_errors` only).
    Counters: `num_calls`, `num_errors` (every failed call, timeouts included), `num_timeouts`.
    """

    def __init__(self, pool: MCPClientPool | Sequence[MCPServerConfig] | MCPServerConfig, *,
                 timeout_s: float | None = None, tool_role: str = "tool", done_when_no_call: bool = False,
                 max_calls: int | None = None, wrap_responses: bool = True) -> None:
        super().__init__()
        self._owns_pool = not isinstance(pool, MCPClientPool)
        self.pool = MCPClientPool(pool) if self._owns_pool else pool
        self.timeout_s = timeout_s
        self.tool_role = tool_role
        self.done_when_no_call = done_when_no_call
        self.max_calls = max_calls
        self.wrap_responses = wrap_responses
        self.num_calls = self.num_errors = self.num_timeouts = 0

    def tool_descriptions(self) -> list[dict[str, Any]]:
        """The tools in OpenAI/Hermes function format: `{"type": "function", "function":
        {"name", "description", "parameters"}}` (the input schema), for prompts or `tools=`."""
        return [spec.to_openai() for spec in self.pool.tools.values()]

    def system_prompt(self, preamble: str = "") -> str:
        return system_prompt_for_tools(self.tool_descriptions(), preamble)

    def execute(self, call: ToolCall) -> str:
        """The result text of one call, or `{"error": ...}`; never raises."""
        self.num_calls += 1
        try:
            if call.error is not None:
                raise MCPToolError(call.error)
            try:
                server, tool = self.pool.resolve(call.name)
            except KeyError:
                raise MCPToolError(f"unknown tool {call.name!r}; available: {', '.join(self.pool.tools)}") from None
            return self.pool.call_tool_sync(server, tool, call.arguments, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a failed call must not kill the rollout
            self.num_errors += 1
            if isinstance(exc, MCPToolTimeout):
                self.num_timeouts += 1
            logger.debug("MCPToolTransform: call %r failed: %s", call.name, exc)
            return json.dumps({"error": str(exc) if isinstance(exc, MCPToolError) else f"{type(exc).__name__}: {exc}"})

    def step(self, td_next: TensorDictBase, td_action: TensorDictBase) -> TensorDictBase:
        for nxt, act in zip(td_next.unbind(0), td_action.unbind(0)):
            full = self.env.history_of(act, "full").to_chat()
            last = full[-1]["content"] if full and full[-1]["role"] == "assistant" else ""
            calls = parse_tool_calls(last)
            if not calls:
                if self.done_when_no_call:
                    nxt["done"] = torch.ones(1, dtype=torch.bool)
                    nxt["terminated"] = torch.ones(1, dtype=torch.bool)
                continue
            results = []
            for i, call in enumerate(calls):
                if self.max_calls is not None and i >= self.max_calls:
                    self.num_errors += 1
                    results.append(json.dumps({"error": f"too many tool calls (max {self.max_calls} per turn)"}))
                else:
                    results.append(self.execute(call))
            if self.wrap_responses:
                results = [f"<tool_response>\n{r}\n</tool_response>" for r in results]
            self.env.add_messages(nxt, {"role": self.tool_role, "content": "\n".join(results)})
        return td_next

    def close(self) -> None:
        """Close the pool if this transform created it."""
        if self._owns_pool:
            self.pool.close()

    def __repr__(self) -> str:
        return (f"MCPToolTransform(servers={list(self.pool.configs)}, tools={list(self.pool.tools)}, "
                f"role={self.tool_role!r})")
