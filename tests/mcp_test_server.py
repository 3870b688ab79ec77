"""A small real MCP server for the tests (mcp 2.x `MCPServer`, the successor of FastMCP).

    python tests/mcp_test_server.py stdio
    python tests/mcp_test_server.py http --port 8765     # streamable HTTP on 127.0.0.1:8765/mcp

Tools: add(a, b) -> a + b, echo(text) -> text, sleep(seconds) -> "slept N", fail() -> raises.
"""
from __future__ import annotations

import argparse
import asyncio

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("transport", choices=["stdio", "http"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    if args.transport == "stdio":
        mcp.run("stdio")
    else:
        mcp.run("streamable-http", host=args.host, port=args.port)


if __name__ == "__main__":
    main()
