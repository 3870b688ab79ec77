"""MCP tools against a real MCP server (tests/mcp_test_server.py), over stdio and streamable HTTP.

The test plays the policy by writing ("history", "full"), as in test_chat_env.py.
"""
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import mcp  # noqa: E402,F401  (a core dependency: missing, it is a failure, not a skip)

from rayllm_rl.envs import ChatEnv  # noqa: E402
from rayllm_rl.tools.mcp_tools import (  # noqa: E402
    MCPClientPool,
    MCPServerConfig,
    MCPToolError,
    MCPToolTimeout,
    MCPToolTransform,
    parse_tool_calls,
    system_prompt_for_tools,
)

SERVER = str(Path(__file__).with_name("mcp_test_server.py"))
TOOLS = {"add", "echo", "sleep", "fail"}


def stdio_config(name="test", **kw):
    return MCPServerConfig(name=name, transport="stdio", command=sys.executable, args=[SERVER, "stdio"], **kw)


def children() -> set[int]:
    """Live (non-zombie) direct children of this process, from /proc."""
    me, out = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # state, ppid, ...
        if int(fields[1]) == me and fields[0] != "Z":
            out.add(int(entry))
    return out


@pytest.fixture(scope="module")
def pool():
    with MCPClientPool(stdio_config(timeout_s=10.0)) as p:
        yield p


def make_env(tokenizer, transform, batch_size=1, **kw):
    env = ChatEnv(tokenizer, input_mode="history", system_prompt="You can call tools.", batch_size=batch_size, **kw)
    return env.append_transform(transform)


def play(env, texts):
    """Reset with one query per element, write one assistant message per element, step."""
    td = env.reset(TensorDict(query=[f"q{i}" for i in range(len(texts))], batch_size=[len(texts)]))
    for elem, text in zip(td.unbind(0), texts):
        elem["history"].full = elem["history"].prompt.append({"role": "assistant", "content": text})
    return env.step(td)


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def responses(content):
    """The bodies of the <tool_response> blocks of a tool message."""
    parts = content.split("<tool_response>\n")[1:]
    return [p.split("\n</tool_response>")[0] for p in parts]


# ---------------------------------------------------------------------------- parsing (no server)
def test_parse_tool_calls():
    text = 'x <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> y ' + call("echo", text="t")
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1, "b": 2}, None),
                                                               ("echo", {"text": "t"}, None)]
    assert parse_tool_calls("no call here") == []
    bad = parse_tool_calls('<tool_call>{"name": "add", "arguments": {</tool_call><tool_call>[1]</tool_call>'
                           '<tool_call>{"name": "x", "arguments": 3}</tool_call><tool_call>{"name": "add"')
    assert len(bad) == 4 and all(c.error and c.error.startswith("malformed tool call") for c in bad)
    assert (parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}</tool_call>')[0].arguments
            == {"k": 1})


# ---------------------------------------------------------------------------- stdio
@pytest.mark.slow
def test_stdio_list_and_call(pool):
    assert set(pool.tools) == TOOLS
    assert {t.name for t in pool.list_tools_sync("test")} == TOOLS
    assert pool.call_tool_sync("test", "add", {"a": 2, "b": 3}) == "5"
    assert pool.call_tool_sync("test", "echo", {"text": "héllo"}) == "héllo"
    with pytest.raises(MCPToolError, match="fail"):
        pool.call_tool_sync("test", "fail", {})
    with pytest.raises(MCPToolError):
        pool.call_tool_sync("nope", "add", {})
    spec = pool.tools["add"]
    assert (spec.server, spec.tool, spec.description) == ("test", "add", "Add two integers.")
    assert set(spec.input_schema["properties"]) == {"a", "b"}
    assert pool.resolve("add") == pool.resolve("test.add") == ("test", "add")


@pytest.mark.slow
def test_tool_descriptions_and_system_prompt(pool):
    t = MCPToolTransform(pool)
    descs = t.tool_descriptions()
    assert {d["function"]["name"] for d in descs} == TOOLS
    assert all(d["type"] == "function" and "parameters" in d["function"] for d in descs)
    prompt = t.system_prompt("You are helpful.")
    assert prompt.startswith("You are helpful.\n\n# Tools") and "<tools>\n" in prompt and "\n</tools>" in prompt
    assert '"name": "add"' in prompt and "<tool_call>" in prompt
    assert system_prompt_for_tools(list(pool.tools.values())) == system_prompt_for_tools(descs)


@pytest.mark.slow
def test_transform_single_call(pool, tokenizer):
    t = MCPToolTransform(pool)
    env = make_env(tokenizer, t)
    out = play(env, ["Let me add. " + call("add", a=2, b=3)])
    nxt = out["next"][0]
    chat = nxt["history"].prompt.to_chat()
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "tool"]
    assert chat[-1]["content"] == "<tool_response>\n5\n</tool_response>"
    assert not nxt["done"].any() and not nxt["terminated"].any()
    assert (t.num_calls, t.num_errors, t.num_timeouts) == (1, 0, 0)


@pytest.mark.slow
def test_transform_multiple_calls_batch_with_tokenizer(pool, tokenizer):
    t = MCPToolTransform(pool, tool_role="user")
    env = make_env(tokenizer, t, batch_size=2, with_tokenizer=True)
    out = play(env, [call("add", a=1, b=1) + "\n" + call("echo", text="hi there") + call("add", a=-4, b=10),
                     "The answer is 5."])
    first, second = (out["next"][i] for i in range(2))
    chat = first["history"].prompt.to_chat()
    assert chat[-1]["role"] == "user" and responses(chat[-1]["content"]) == ["2", "hi there", "6"]
    assert second["history"].prompt.to_chat()[-1]["role"] == "assistant"  # no call: nothing added
    assert not out["next", "done"].any()
    # the IncrementalTokenizer rendered the tool message after the policy's ids
    text = tokenizer.decode(first["tokens", "prompt"].tolist())
    assert text.endswith("<|im_start|>user\n" + chat[-1]["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    assert t.num_calls == 3 and t.num_errors == 0


@pytest.mark.slow
def test_transform_errors_never_raise(pool, tokenizer):
    t = MCPToolTransform(pool)
    env = make_env(tokenizer, t)
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>'
            + call("no_such_tool", x=1) + call("fail") + call("add", a="x", b=1) + call("add", a=3, b=4))
    out = play(env, [text])
    got = responses(out["next"][0]["history"].prompt.to_chat()[-1]["content"])
    assert len(got) == 5
    errors = [json.loads(r)["error"] for r in got[:4]]
    assert errors[0].startswith("malformed tool call")
    assert "unknown tool 'no_such_tool'" in errors[1] and "add" in errors[1]
    assert "tool 'fail' failed" in errors[2]
    assert "tool 'add' failed" in errors[3]
    assert got[4] == "7"  # later calls still run
    assert (t.num_calls, t.num_errors, t.num_timeouts) == (5, 4, 0)


@pytest.mark.slow
def test_no_call_and_done_when_no_call(pool, tokenizer):
    out = play(make_env(tokenizer, MCPToolTransform(pool)), ["Just an answer."])
    assert [m["role"] for m in out["next"][0]["history"].prompt.to_chat()] == ["system", "user", "assistant"]
    assert not out["next", "done"].any()
    t = MCPToolTransform(pool, done_when_no_call=True)
    out = play(make_env(tokenizer, t, batch_size=2), ["Final answer: 5", call("echo", text="more")])
    assert out["next", "done"].tolist() == [[True], [False]]
    assert out["next", "terminated"].tolist() == [[True], [False]]


@pytest.mark.slow
def test_timeout_then_still_works(pool, tokenizer):
    t = MCPToolTransform(pool, timeout_s=1.0, max_calls=1)
    env = make_env(tokenizer, t)
    start = time.monotonic()
    out = play(env, [call("sleep", seconds=5) + call("add", a=1, b=2)])
    elapsed = time.monotonic() - start
    assert elapsed < 4.5, elapsed  # the tool sleeps 5 s: the 1 s timeout cut it (slack for a loaded machine)
    got = responses(out["next"][0]["history"].prompt.to_chat()[-1]["content"])
    assert json.loads(got[0]) == {"error": "tool 'sleep' timed out after 1s"}
    assert "too many tool calls" in json.loads(got[1])["error"]
    assert (t.num_calls, t.num_errors, t.num_timeouts) == (1, 2, 1)
    with pytest.raises(MCPToolTimeout):
        pool.call_tool_sync("test", "sleep", {"seconds": 3}, timeout=0.5)
    out = play(env, [call("add", a=2, b=3)])  # the session survived the timeouts
    assert responses(out["next"][0]["history"].prompt.to_chat()[-1]["content"]) == ["5"]
    assert pool.call_tool_sync("test", "sleep", {"seconds": 0.1}, timeout=5) == "slept 0.1"


@pytest.mark.slow
def test_concurrent_sync_callers(pool):
    results = [None] * 8

    def work(i):
        results[i] = pool.call_tool_sync("test", "add", {"a": i, "b": 100})

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert results == [str(i + 100) for i in range(8)]


# ---------------------------------------------------------------------------- lifecycle
@pytest.mark.slow
def test_two_servers_qualified_names_and_no_leaked_processes(tokenizer):
    before = children()
    t = MCPToolTransform([stdio_config("a"), stdio_config("b")])  # the transform owns this pool
    try:
        spawned = children() - before
        assert len(spawned) == 2
        assert set(t.pool.tools) == {f"{s}.{n}" for s in "ab" for n in TOOLS}  # ambiguous: qualified
        out = play(make_env(tokenizer, t), [call("b.echo", text="from b") + call("add", a=1, b=1)])
        got = responses(out["next"][0]["history"].prompt.to_chat()[-1]["content"])
        assert got[0] == "from b" and "unknown tool 'add'" in json.loads(got[1])["error"]
        loop_thread = t.pool.loop_thread
        assert loop_thread.is_alive()
    finally:
        t.close()
    assert not (children() & spawned)
    assert all(not Path(f"/proc/{pid}").exists() for pid in spawned)  # reaped, not zombies
    assert not loop_thread.is_alive()
    t.close()  # idempotent
    with pytest.raises(MCPToolError):
        t.pool.call_tool_sync("a", "add", {"a": 1, "b": 1})


@pytest.mark.slow
def test_server_crash_gives_error_text(tokenizer):
    before = children()
    t = MCPToolTransform(stdio_config("crashy"))
    try:
        for pid in children() - before:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.3)
        out = play(make_env(tokenizer, t), [call("add", a=1, b=2)])
        error = json.loads(responses(out["next"][0]["history"].prompt.to_chat()[-1]["content"])[0])["error"]
        assert error.startswith("tool 'add' failed") and t.num_errors == 1
    finally:
        t.close()
    assert not children() - before


@pytest.mark.slow
def test_connect_failure_raises_and_cleans_up():
    before = children()
    with pytest.raises(ConnectionError, match="bad"):
        MCPClientPool([stdio_config("good"), MCPServerConfig("bad", command="/nonexistent/mcp-server")])
    deadline = time.monotonic() + 5
    while children() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not children() - before
    with pytest.raises(ValueError):
        MCPServerConfig("x", transport="http")  # no url


# ---------------------------------------------------------------------------- streamable HTTP
def served_url(proc: subprocess.Popen, timeout_s: float) -> str:
    """The URL mcp_test_server.py prints once it serves ("listening on URL"); AssertionError past `timeout_s`."""
    deadline, out = time.monotonic() + timeout_s, b""
    while True:
        for line in out.decode(errors="replace").splitlines(keepends=True):
            if line.startswith("listening on ") and line.endswith("\n"):
                return line.split()[-1]
        assert proc.poll() is None, "the HTTP MCP server exited"
        remaining = deadline - time.monotonic()
        assert remaining > 0, "the HTTP MCP server did not say where it listens"
        if select.select([proc.stdout], [], [], min(remaining, 0.5))[0]:
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, "the HTTP MCP server closed its stdout"
            out += chunk


@pytest.mark.slow
def test_http_echo_through_transform(tokenizer):
    proc = subprocess.Popen([sys.executable, SERVER, "http", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    t = None
    try:
        url = served_url(proc, timeout_s=30)  # the server binds a free port itself and prints it
        assert url.startswith("http://127.0.0.1:") and url.endswith("/mcp"), url
        cfg = MCPServerConfig("remote", transport="http", url=url, timeout_s=5.0)
        t = MCPToolTransform(cfg)
        assert set(t.pool.tools) == TOOLS
        out = play(make_env(tokenizer, t), ["Echoing. " + call("echo", text="over http")])
        chat = out["next"][0]["history"].prompt.to_chat()
        assert chat[-1] == {"role": "tool", "content": "<tool_response>\nover http\n</tool_response>"}
        assert t.pool.call_tool_sync("remote", "add", {"a": 20, "b": 22}) == "42"
        with pytest.raises(MCPToolTimeout):
            t.pool.call_tool_sync("remote", "sleep", {"seconds": 5}, timeout=0.5)
        assert t.pool.call_tool_sync("remote", "echo", {"text": "still here"}) == "still here"
    finally:
        if t is not None:
            t.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert torch.is_tensor(out["next", "done"])


@pytest.mark.slow
def test_tool_agent_episodes_close_their_own_mcp_servers(tokenizer):
    """A ToolAgentWorkflow whose make_tools builds an MCPToolTransform from configs (one pool, one server
    process per episode) calls a real tool, and every episode's server is gone when the episode ends."""
    import asyncio

    from rayllm_rl.agents.tool_agent import ToolAgentWorkflow
    from rayllm_rl.inference.protocol import LLMResponse, SamplingParams

    class Scripted:  # the policy: a tool call, then an answer
        def __init__(self):
            self.turns = {}

        async def agenerate(self, req):
            n = self.turns[req.rid] = self.turns.get(req.rid, 0) + 1
            text = call("add", a=2, b=3) if n == 1 else "<answer>5</answer>"
            ids = (tokenizer(text, add_special_tokens=False)["input_ids"]
                   + [tokenizer.convert_tokens_to_ids("<|im_end|>")])
            return LLMResponse(input_tokens=list(req.input_ids), output_tokens=ids, output_logprobs=[-0.1] * len(ids),
                               output_versions=[0] * len(ids), stop_reason="stop", rid=req.rid)

    before = children()
    wf = ToolAgentWorkflow(tokenizer, lambda: [MCPToolTransform(stdio_config(), done_when_no_call=True)],
                           SamplingParams(max_new_tokens=32), group_size=2, max_turns=3)
    out = asyncio.run(wf.arun_episode(Scripted(), {"messages": [{"role": "user", "content": "2+3?"}]}))
    assert out["num_turns"].tolist() == [2.0, 2.0]
    text = tokenizer.decode(out["input_ids"][0][out["attention_mask"][0].bool()])
    assert "<tool_response>\n5\n</tool_response>" in text
    assert not children() - before  # both episodes' server processes were closed with their envs
