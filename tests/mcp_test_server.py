"""A small real MCP server for the tests (mcp 2.x `MCPServer`, the successor of FastMCP).

    python tests/mcp_test_server.py stdio
    python tests/mcp_test_server.py http [--port N]      # streamable HTTP on 127.0.0.1:N/mcp

HTTP binds port N, by default 0 (a free port, bound by this process), and prints
"listening on http://127.0.0.1:PORT/mcp" on stdout once it serves: the port is never picked by the caller.

Tools: add(a, b) -> a + b, echo(text) -> text, sleep(seconds) -> "slept N", fail() -> raises.
"""
from __future__ import annotations

import argparse
import asyncio
import socket

from mcp.server.mcpserver import MCPServer

mcp = MCPServer("rayllm-test", log_level="CRITICAL")  # quiet: `fail` would print a rich traceback (~0.5 s)


@mcp.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@mcp.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@mcp.tool()
async def sleep(seconds: float) -> str:
    """Sleep for `seconds` seconds, then say so."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@mcp.tool()
def fail() -> str:
    """Always raise an error."""
    raise RuntimeError("boom")


async def serve_http(host: str, port: int) -> None:
    """Streamable HTTP on a socket this process binds (port 0: any free one); prints its URL once serving."""
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(mcp.streamable_http_app(host=host), log_level="critical"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.01)
    if server.started:
        print(f"listening on http://{host}:{sock.getsockname()[1]}/mcp", flush=True)
    await serving


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("transport", choices=["stdio", "http"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 (default): a free port, printed once serving")
    args = parser.parse_args()
    if args.transport == "stdio":
        mcp.run("stdio")
    else:
        asyncio.run(serve_http(args.host, args.port))


if __name__ == "__main__":
    main()
