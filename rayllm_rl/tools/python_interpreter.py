"""PythonInterpreter: run the ```python blocks of the last assistant message in a sandbox (TorchRL's transform).

The code runs in a `PythonSandbox` (a separate, limited process; see docs/tools.md) or through
any executor with the same `run(code, timeout=...)` signature, such as a PythonExecutorService
actor shared by many env workers. The results come back as one message wrapped in
`<tool_response>`, formatted as in the seed's example.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Callable

from tensordict import TensorDictBase

from rayllm_rl.envs.transforms import Transform

logger = logging.getLogger(__name__)

CODE_BLOCK_RE = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)

# Persistent sessions replay earlier blocks with their output silenced, then run the new ones.
_REPLAY_TEMPLATE = """import contextlib as _ctx, io as _io
_g = {{"__name__": "__main__"}}
for _src in {past!r}:
    try:
        with _ctx.redirect_stdout(_io.StringIO()), _ctx.redirect_stderr(_io.StringIO()):
            exec(compile(_src, "<previous block>", "exec"), _g)
    except BaseException:
        pass
exec(compile({new!r}, "<block>", "exec"), _g)
"""


def extract_code_blocks(text: str) -> list[str]:
    """The bodies of the ```python (or ```py) fenced blocks in `text`, in order."""
    return [block for block in CODE_BLOCK_RE.findall(text or "") if block.strip()]


def format_result(index: int, result: Any) -> str:
    """Seed format: 'Code block i executed successfully:\\n<stdout>' or the failure with stderr."""
    out = result.stdout + ("\n[output truncated]" if getattr(result, "stdout_truncated", False) else "")
    if result.timed_out:
        return f"Code block {index} timed out.\n{out}"
    if result.exit_code == 0:
        return f"Code block {index} executed successfully:\n{out}"
    err = result.stderr + ("\n[output truncated]" if getattr(result, "stderr_truncated", False) else "")
    return f"Code block {index} failed (exit code {result.exit_code}):\n{out}{err}"


class PythonInterpreter(Transform):
    """After each step, runs the python blocks of the last assistant message and appends the results.

    `executor`: an object with `run(code, timeout=...)` returning a SandboxResult-like object
    (default: a fresh `PythonSandbox()`). With `persistent=True`, the blocks of earlier turns of
    the same episode are re-run first with their output silenced, so that variables and functions
    persist across turns. Their side effects, files included, happen again. The results go into
    one `tool_role` message, default "tool", or "user" for templates without a tool role:
    `<tool_response>\\n...\\n</tool_response>`. A message without code adds nothing. An executor
    that raises gives an error text in the response and counts in `num_errors`, never a crash.
    """

    carry_keys = ("python_history",)

    def __init__(self, executor: Any = None, *, timeout_s: float = 10.0, tool_role: str = "tool",
                 persistent: bool = False, done_when_no_code: bool = False) -> None:
        super().__init__()
        if executor is None:
            from rayllm_rl.tools.sandbox import PythonSandbox

            executor = PythonSandbox()
        self.executor = executor
        self.run: Callable[..., Any] = executor.run if hasattr(executor, "run") else executor
        self.timeout_s = timeout_s
        self.tool_role = tool_role
        self.persistent = persistent
        self.done_when_no_code = done_when_no_code
        self.num_runs = 0
        self.num_errors = 0

    def _execute(self, index: int, code: str, past: list[str]) -> str:
        source = _REPLAY_TEMPLATE.format(past=past, new=code) if self.persistent and past else code
        self.num_runs += 1
        try:
            return format_result(index, self.run(source, timeout=self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - a broken executor must not kill the rollout
            self.num_errors += 1
            logger.warning("PythonInterpreter: executor raised %r", exc)
            return f"Code block {index} could not be run: {type(exc).__name__}: {exc}"

    def step(self, td_next: TensorDictBase, td_action: TensorDictBase) -> TensorDictBase:
        import torch
        from tensordict import NonTensorData

        for nxt, act in zip(td_next.unbind(0), td_action.unbind(0)):
            full = self.env.history_of(act, "full").to_chat()
            last = next((m["content"] for m in reversed(full) if m["role"] == "assistant"), "")
            blocks = extract_code_blocks(last)
            past = list(act["python_history"]) if "python_history" in act.keys() else []
            if not blocks:
                if self.done_when_no_code:
                    nxt["done"] = torch.ones(1, dtype=torch.bool)
                    nxt["terminated"] = torch.ones(1, dtype=torch.bool)
                continue
            parts = []
            for i, code in enumerate(blocks, start=1):
                parts.append(self._execute(i, code, past))
                past.append(code)
            nxt["python_history"] = NonTensorData(past)
            body = "\n".join(parts)
            self.env.add_messages(nxt, {"role": self.tool_role,
                                        "content": f"<tool_response>\n{body}\n</tool_response>"})
        return td_next

    def __repr__(self) -> str:
        return f"PythonInterpreter(timeout_s={self.timeout_s}, persistent={self.persistent}, role={self.tool_role!r})"
