"""An OpenAI-compatible chat-completions endpoint in front of an inference engine, recording tokens.

Agent code written against the `openai` package talks to `ChatCompletionsApp`, an ASGI app, and
never knows it is being trained. Every completion's exact prompt ids, output ids, logprobs and
policy versions are recorded, and `trajectories()` turns them into training TensorDicts. Within
one session, a request that continues an earlier conversation (its messages start with that
request's messages plus the assistant reply we returned) reuses the earlier token ids and only
tokenizes the new messages, like the IncrementalTokenizer. Multi-turn agents therefore train on
exactly the tokens the engine saw; nothing in the past is re-tokenized. The app serves in-process
through `httpx2.ASGITransport` (see `openai_client`). It is also a plain ASGI app, so uvicorn can
put it on a port for agents in other processes.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any, Callable, Sequence

from rayllm_rl.data.trajectory import TrajectoryBuilder
from rayllm_rl.data.chat_template import chat_suffix, decode_tokens, encode_text
from rayllm_rl.inference.protocol import InferenceEngine, LLMRequest, SamplingParams
from rayllm_rl.tools.mcp_tools import parse_tool_calls as parse_hermes_tool_calls



@dataclasses.dataclass
class CompletionRecord:
    """One chat completion as the engine saw and produced it."""

    messages: list[dict[str, Any]]
    """The request's messages (normalised to role/content)."""
    reply: dict[str, Any]
    """The assistant message we returned."""
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    parent: int | None
    """Index of the record this request continued (its tokens are a prefix of ours), or None."""
    finish_reason: str

    # LLMResponse's names, so `TrajectoryBuilder.add_generated` takes a record
    output_tokens = property(lambda self: self.output_ids)
    output_logprobs = property(lambda self: self.logprobs)
    output_versions = property(lambda self: self.versions)


def _norm(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"each message needs a role, got {m!r:.100}")
        content = m.get("content") or ""
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append({"role": m["role"], "content": str(content)})
    return out


def parse_tool_calls(text: str, tool_parser: Callable[[str], Any] | None = None) -> list[dict[str, Any]]:
    """The reply's tool calls as OpenAI tool_calls: Hermes/Qwen `<tool_call>{"name", "arguments"}</tool_call>`
    blocks (the MCP transform's parser; malformed calls are left out, their text stays in the content), or what
    `tool_parser(text)` finds, `[(name, arguments dict), ...]` (a model with another call format)."""
    calls = ([(c.name, c.arguments) for c in parse_hermes_tool_calls(text) if c.error is None]
             if tool_parser is None else list(tool_parser(text)))
    return [{"id": f"call_{i}_{uuid.uuid4().hex[:8]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments)}}
            for i, (name, arguments) in enumerate(calls)]


class ChatCompletionsSession:
    """Serves chat completions from `engine` for one episode and records every completion."""

    def __init__(self, engine: InferenceEngine, tokenizer, *, default_max_tokens: int = 256,
                 model_name: str = "rayllm-policy", rid: str | None = None, sampling: SamplingParams | None = None,
                 tool_parser: Callable[[str], Any] | None = None):
        self.engine = engine
        self.sampling = sampling
        """The job's rollout temperature / top_p / top_k: a request leaving one out gets the job's, and one
        asking another value is refused, since the learner scores every token at the job's (None: any)."""
        self.tokenizer = tokenizer
        self.default_max_tokens = default_max_tokens
        self.model_name = model_name
        self.rid = rid or uuid.uuid4().hex
        self.records: list[CompletionRecord] = []
        self.tool_parser = tool_parser
        """How a reply's tool calls are found when the request offers `tools` (`parse_tool_calls`; None: Hermes)."""

    # ------------------------------------------------------------------ prompt tokens
    def _prompt_ids(self, messages: list[dict[str, Any]], tools: Any) -> tuple[list[int], int | None]:
        """Token ids of the prompt; reuse a recorded conversation this one continues (longest first)."""
        for idx in sorted(range(len(self.records)), key=lambda i: -len(self.records[i].messages)):
            rec = self.records[idx]
            past = rec.messages + [{"role": "assistant", "content": rec.reply["content"]}]
            if len(messages) > len(past) and messages[: len(past)] == past:
                base = rec.prompt_ids + rec.output_ids
                suffix = chat_suffix(self.tokenizer, decode_tokens(self.tokenizer, base), past, messages[len(past):])
                return base + encode_text(self.tokenizer, suffix).tolist(), idx
        kwargs = {"tools": tools} if tools else {}
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                 return_dict=False, **kwargs)
        return list(ids), None

    def _sampling(self, body: dict[str, Any], max_tokens: int) -> SamplingParams:
        """The request's sampling: the job's temperature / top_p / top_k where it gives none; temperature 0 is
        greedy, and so is a request without a temperature of a greedy job (the held-out evaluation's). Another value
        than the job's fails, naming both (its logprobs would not be the learner's)."""
        job = self.sampling or SamplingParams()
        temperature = float(body["temperature"]) if body.get("temperature") is not None else job.temperature
        top_p = float(body["top_p"]) if body.get("top_p") is not None else job.top_p
        if self.sampling is not None and temperature != 0.0:
            for key, asked, own in (("temperature", temperature, job.temperature), ("top_p", top_p, job.top_p)):
                if asked != own:
                    raise ValueError(f"{key}={asked:g} in the request, but the job samples and scores at "
                                     f"rollout.{key}={own:g}; leave {key} out or set rollout.{key}")
        return SamplingParams(max_new_tokens=max_tokens, temperature=max(temperature, 1e-6), top_p=top_p,
                              top_k=job.top_k, greedy=temperature == 0.0 or (body.get("temperature") is None
                                                                              and job.greedy))

    # ------------------------------------------------------------------ the endpoint
    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """Handle one /v1/chat/completions request body; returns the response body."""
        if body.get("stream"):
            raise ValueError("stream=True is not supported by this endpoint")
        messages = _norm(body.get("messages") or [])
        if not messages:
            raise ValueError("messages must be a non-empty list")
        n = int(body.get("n") or 1)
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or self.default_max_tokens)
        sampling = self._sampling(body, max_tokens)
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        prompt_ids, parent = self._prompt_ids(messages, body.get("tools"))
        choices, usage_out = [], 0
        base = len(self.records)  # the n samples run concurrently, so the engine batches them
        resps = await asyncio.gather(*(self.engine.agenerate(LLMRequest(
            input_ids=list(prompt_ids), sampling=sampling, rid=f"{self.rid}-{base + i}")) for i in range(n)))
        for i, resp in enumerate(resps):
            out_ids, lps, vers, finish = self.apply_stop(resp, stops)
            text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
            reply: dict[str, Any] = {"role": "assistant", "content": text}
            tool_calls = parse_tool_calls(text, self.tool_parser) if body.get("tools") else []
            if tool_calls:
                reply["tool_calls"] = tool_calls
                finish = "tool_calls"
            self.records.append(CompletionRecord(messages, {"role": "assistant", "content": text}, list(prompt_ids),
                                                 out_ids, lps, vers, parent, finish))
            choice: dict[str, Any] = {"index": i, "message": reply, "finish_reason": finish}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [
                    {"token": self.tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(out_ids, lps)]}
            choices.append(choice)
            usage_out += len(out_ids)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or self.model_name, "choices": choices,
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": usage_out,
                          "total_tokens": len(prompt_ids) + usage_out}}

    def apply_stop(self, resp, stops: list[str]):
        """Cut `resp`'s output at the first token whose text completes a stop string (OpenAI `stop`): returns
        (token ids, logprobs, versions, finish reason "stop" or "length"), as `create` answers a request.
        One decode of the whole output first; the per-prefix search runs only when a stop string is there."""
        ids, lps, vers = list(resp.output_tokens), list(resp.output_logprobs), list(resp.output_versions)
        finish = "length" if resp.stop_reason == "length" else "stop"
        full = self.tokenizer.decode(ids, skip_special_tokens=True) if stops else ""
        if any(s and s in full for s in stops):
            for k in range(1, len(ids) + 1):
                text = self.tokenizer.decode(ids[:k], skip_special_tokens=True)
                if any(s and s in text for s in stops):
                    return ids[:k], lps[:k], vers[:k], "stop"
        return ids, lps, vers, finish

    # ------------------------------------------------------------------ trajectories
    def trajectories(self, reward: float, group_id: int = 0, **extra: float):
        """One trajectory per conversation leaf (a completion no later request continued).

        Tokens are the leaf's prompt + output ids; loss_mask is 1 exactly on tokens the engine
        generated (in this leaf and every completion it continued), with their logprobs and
        versions; everything else (prompts, tool results, user turns) is masked out.
        """
        continued = {r.parent for r in self.records if r.parent is not None}
        out = []
        for idx, leaf in enumerate(self.records):
            if idx in continued:
                continue
            chain, node = [], leaf
            while node is not None:
                chain.append(node)
                node = self.records[node.parent] if node.parent is not None else None
            traj = TrajectoryBuilder()
            for rec in reversed(chain):  # root first: each prompt extends the completion it continued
                try:
                    traj.add_prompt(rec.prompt_ids)
                except ValueError:
                    raise RuntimeError("recorded completion is not a prefix of its continuation") from None
                traj.add_generated(rec)
            out.append(traj.build(reward, group_id, num_completions=float(len(chain)), **extra))
        return out


class ChatCompletionsApp:
    """ASGI app: POST {/v1}/chat/completions -> `session.create`; GET {/v1}/models; errors as OpenAI JSON."""

    def __init__(self, session: ChatCompletionsSession):
        self.session = session

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"].rstrip("/"), scope["method"]
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        try:
            if method == "POST" and path.endswith("/chat/completions"):
                status, payload = 200, await self.session.create(json.loads(body or b"{}"))
            elif method == "GET" and path.endswith("/models"):
                status, payload = 200, {"object": "list", "data": [
                    {"id": self.session.model_name, "object": "model", "created": 0, "owned_by": "rayllm_rl"}]}
            else:
                status, payload = 404, {"error": {"message": f"no route {method} {path}", "type": "not_found"}}
        except (ValueError, TypeError, KeyError) as exc:
            status, payload = 400, {"error": {"message": str(exc), "type": "invalid_request_error"}}
        data = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})


def openai_client(session: ChatCompletionsSession, timeout_s: float = 300.0):
    """An `openai.AsyncOpenAI` whose requests go in-process to `session` (no socket)."""
    import httpx2
    import openai

    http = openai.DefaultAsyncHttpxClient(transport=httpx2.ASGITransport(app=ChatCompletionsApp(session)))
    return openai.AsyncOpenAI(base_url="http://rayllm.local/v1", api_key="rayllm-local", http_client=http,
                              timeout=timeout_s, max_retries=0)
