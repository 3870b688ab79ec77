"""MATH answers: `\\boxed{}` extraction and a `math-verify` equivalence check with a hard timeout.

Datasets: hendrycks competition_math rows `{problem, level, type, solution}` (the reference is
the last `\\boxed{...}` of `solution`) and MATH-500 rows `{problem, solution, answer, subject,
level, unique_id}` (the reference is `answer`).

Why a process: sympy can run for hours on a model's answer (`9^{9^{9^{9}}}` never finishes
because it is computed with exact big-int arithmetic inside C code), and math-verify's own
timeout uses `signal.alarm`, which only works in the main thread of the main interpreter - not
in Ray actors' threads or asyncio executors. `MathVerifier` therefore disables math-verify's
timeout and runs every check in a long-lived worker process it can terminate and respawn.
"""
from __future__ import annotations

import asyncio
import importlib
import logging
import multiprocessing
import re
import threading
import time
import weakref
from typing import Any, Callable

from rayllm_rl.rewards.gsm8k import extract_tag_blocks

__all__ = ["MathRewardFn", "MathVerifier", "last_boxed", "math_reference_answer"]

log = logging.getLogger(__name__)

DEFAULT_CHECK_FN = "rayllm_rl.rewards.math_answer._verify_pair"

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{|\\boxed[ \t]+(?P<bare>[^\s${}]+)")


def last_boxed(text: str | None) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (braces balanced, nesting allowed).

    "Last" means the last outermost box, so `\\boxed{\\frac{\\sqrt{3}}{2}}` gives
    `\\frac{\\sqrt{3}}{2}` and a box inside a box is returned whole by its parent. Unclosed boxes
    are skipped; the old MATH style `\\boxed 5` is accepted. One pass over the text: brace pairs
    are matched once with a stack, so adversarial input stays linear.
    """
    if not text or "\\boxed" not in text and "\\fbox" not in text:
        return None
    closing: dict[int, int] = {}
    stack: list[int] = []
    for i, ch in enumerate(text):
        if ch == "{" and (i == 0 or text[i - 1] != "\\"):
            stack.append(i)
        elif ch == "}" and stack and (i == 0 or text[i - 1] != "\\"):
            closing[stack.pop()] = i
    result, pos = None, 0
    while True:
        m = _BOX_RE.search(text, pos)
        if m is None:
            return result
        if m.group("bare") is not None:
            result, pos = m.group("bare"), m.end()
            continue
        brace = m.end() - 1
        end = closing.get(brace)
        if end is None:  # unclosed: look for later boxes inside it
            pos = m.end()
            continue
        result, pos = text[brace + 1:end], end + 1


def math_reference_answer(row: dict[str, Any]) -> str:
    """The reference answer of a MATH row: `answer` (MATH-500) else the last box of `solution`."""
    answer = row.get("answer")
    if answer is not None and str(answer).strip():
        return str(answer).strip()
    boxed = last_boxed(row.get("solution"))
    if boxed is not None and boxed.strip():
        return boxed.strip()
    raise ValueError("MATH row needs an 'answer' field or a 'solution' field containing \\boxed{...}; "
                     f"got fields {sorted(row)}")


# ----------------------------------------------------------------------------------------------
# Worker-side functions (run inside the verifier process).

def _braces_balanced(s: str) -> bool:
    depth = 0
    for ch in s:
        depth += (ch == "{") - (ch == "}")
        if depth < 0:
            return False
    return depth == 0


_PROSE_RE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}[ \t]+[A-Za-z]{2,}")


def _parse_answer(text: str) -> list:
    """math_verify.parse with LaTeX + expression extraction; a bare answer is wrapped in
    `\\boxed{}` (else `$...$`) first so "1/2", "\\frac12" and "0.5" all parse."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    s = str(text).strip()
    if not s:
        return []
    delimited = any(tok in s for tok in ("\\boxed", "\\fbox", "$", "\\(", "\\["))
    wrapped = s if delimited else ("\\boxed{%s}" % s if _braces_balanced(s) else f"${s}$")
    # Prose ("The answer is 5") would parse as a product of letters once boxed: let math-verify's
    # own anchors ("answer is") read it raw first.
    attempts = [s, wrapped] if _PROSE_RE.search(s) else [wrapped, s]
    for candidate in dict.fromkeys(attempts):
        parsed = parse(candidate, config, parsing_timeout=None, raise_on_error=True)
        if parsed:
            return parsed
    return []


def _verify_pair(gold: str, pred: str) -> bool:
    """Default check: math_verify.verify(parse(gold), parse(pred)), math-verify timeouts off."""
    from math_verify import verify

    gold_parsed, pred_parsed = _parse_answer(gold), _parse_answer(pred)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _sleep_forever_for_tests(gold: str, pred: str) -> bool:
    """TEST HOOK (use as `MathVerifier(check_fn="rayllm_rl.rewards.math_answer._sleep_forever_for_tests")`):
    gold "__sleep__" hangs like a pathological expression, gold "__raise__" raises, anything
    else is checked by `_verify_pair`. Lives here so the spawned worker can import it."""
    if gold == "__sleep__":
        while True:
            time.sleep(3600)
    if gold == "__raise__":
        raise RuntimeError("test hook: raising on purpose")
    return _verify_pair(gold, pred)


def _resolve(path: str) -> Callable[[str, str], bool]:
    module, sep, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not sep or not module:
        raise ValueError(f"check_fn must be a dotted path 'package.module.function', got {path!r}")
    return getattr(importlib.import_module(module), name)


def _worker_main(conn, check_fn_path: str) -> None:
    """Worker loop: warm up (imports sympy/antlr), say "ready", then answer (gold, pred) requests
    with ("ok", bool) or ("error", message) until told to stop (None) or the pipe closes."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # silences "timeout is disabled"
    try:
        fn = _resolve(check_fn_path)
        fn("1", "1")
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("fatal", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if msg is None:
            return
        try:
            result = ("ok", bool(fn(*msg)))
        except Exception as exc:  # noqa: BLE001
            result = ("error", f"{type(exc).__name__}: {exc}")
        try:
            conn.send(result)
        except (OSError, ValueError):
            return


def _stop_process(proc, conn) -> None:
    """Terminate (then kill) a worker and close its pipe; safe to call twice."""
    try:
        conn.close()
    except OSError:
        pass
    if proc.is_alive():
        proc.terminate()
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)


# ----------------------------------------------------------------------------------------------
# Parent side.

class MathVerifier:
    """Answer equivalence via math-verify in a killable, long-lived daemon worker process.

    `check(gold, pred, timeout_s)` -> True/False, or None when the check ran past `timeout_s`
    (the worker is then terminated and a fresh one started; `num_timeouts` counts these). An
    exception inside the check, or a crashed worker, gives False and counts in `num_errors`.
    The timeout covers the check only: worker start-up (spawn + importing sympy, a few seconds,
    bounded by `startup_timeout_s`) is waited for separately, and a failure to start raises
    RuntimeError. One check runs at a time (a lock makes `check` thread-safe; time spent
    waiting for the lock is not counted); `await acheck(...)` waits in a thread. No signals are
    used in the calling process, so it works from any thread, Ray actor or event loop.

    `check_fn` is the dotted path of the `(gold, pred) -> bool` the worker runs (it must be
    importable in a fresh interpreter); `_sleep_forever_for_tests` is a test hook. Pickling a
    verifier ships its settings only; the copy starts its own worker on first use.
    """

    def __init__(self, check_fn: str = DEFAULT_CHECK_FN, default_timeout_s: float = 10.0,
                 start_method: str = "spawn", startup_timeout_s: float = 120.0, queue_timeout_s: float = 600.0) -> None:
        self.check_fn = check_fn
        self.default_timeout_s = float(default_timeout_s)
        self.queue_timeout_s = float(queue_timeout_s)  # bound on waiting for the one worker (checks run in turn)
        self.start_method = start_method
        self.startup_timeout_s = float(startup_timeout_s)
        self.num_checks = 0
        self.num_timeouts = 0
        self.num_errors = 0
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None
        self._ready = False
        self._closed = False
        self._finalizer = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("check_fn", "default_timeout_s", "start_method", "startup_timeout_s",
                                              "queue_timeout_s")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.num_checks = self.num_timeouts = self.num_errors = 0
        self._init_runtime()

    # -- worker lifecycle (callers hold the lock) --
    def _start(self) -> None:
        ctx = multiprocessing.get_context(self.start_method)
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_worker_main, args=(child, self.check_fn), daemon=True, name="math-verifier")
        proc.start()
        child.close()  # only the worker holds its end, so its death reads as EOF here
        self._proc, self._conn, self._ready = proc, parent, False
        self._finalizer = weakref.finalize(self, _stop_process, proc, parent)

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs _stop_process once
        self._proc = self._conn = self._finalizer = None
        self._ready = False

    def _restart(self) -> None:
        """Kill the current worker and start the next one now, so its start-up overlaps idle time."""
        self._stop()
        self._start()

    def _ensure_ready(self):
        if self._proc is None or not self._proc.is_alive():
            self._stop()
            self._start()
        if not self._ready:
            if not self._conn.poll(self.startup_timeout_s):
                self._stop()
                raise RuntimeError(f"MathVerifier worker did not start within {self.startup_timeout_s}s")
            try:
                status, detail = self._conn.recv()
            except (EOFError, OSError) as exc:
                self._stop()
                raise RuntimeError(
                    f"MathVerifier worker died during start-up ({exc!r}). With the {self.start_method!r} start "
                    "method the worker re-imports the main script: it needs an `if __name__ == '__main__':` "
                    "guard (see the multiprocessing docs, 'Safe importing of main module')") from exc
            if status != "ready":
                self._stop()
                raise RuntimeError(f"MathVerifier worker failed to start ({self.check_fn}): {detail}")
            self._ready = True
        return self._conn

    # -- public API --
    @property
    def process(self):
        """The worker process (a `multiprocessing` Process), or None: not started yet, closed, or a copy
        unpickled here (a copy ships settings only and starts its own on first use)."""
        return self._proc

    def start(self) -> "MathVerifier":
        """Start the worker and wait until it is ready (optional: `check` does it lazily)."""
        with self._lock:
            self._ensure_ready()
        return self

    def check(self, gold: str, pred: str, timeout_s: float | None = None) -> bool | None:
        """True if `pred` is mathematically equal to `gold`; None on timeout; False on error.

        `timeout_s` bounds the check itself, not the wait for earlier checks to finish (that wait is
        bounded by `queue_timeout_s`), so a correct answer queued behind slow ones is still scored."""
        timeout_s = self.default_timeout_s if timeout_s is None else float(timeout_s)
        if not self._lock.acquire(timeout=self.queue_timeout_s):
            self.num_timeouts += 1
            return None
        try:
            if self._closed:
                raise RuntimeError("MathVerifier is closed")
            self.num_checks += 1
            conn = self._ensure_ready()
            try:
                conn.send((str(gold), str(pred)))
                if not conn.poll(timeout_s):
                    self.num_timeouts += 1
                    self._restart()
                    return None
                status, value = conn.recv()
            except (EOFError, OSError) as exc:  # worker crashed (segfault, OOM kill)
                self.num_errors += 1
                log.warning("MathVerifier worker died during a check (%r); restarting it", exc)
                self._restart()
                return False
            if status == "ok":
                return bool(value)
            self.num_errors += 1
            log.debug("MathVerifier check raised %s (gold=%.80r pred=%.80r)", value, gold, pred)
            return False
        finally:
            self._lock.release()

    async def acheck(self, gold: str, pred: str, timeout_s: float | None = None) -> bool | None:
        """`check` without blocking the event loop (the wait runs in a thread)."""
        return await asyncio.to_thread(self.check, gold, pred, timeout_s)

    def close(self) -> None:
        """Stop the worker; the verifier cannot be used afterwards."""
        with self._lock:
            self._closed = True
            if self._conn is not None and self._ready:
                try:
                    self._conn.send(None)
                    self._proc.join(1.0)
                except (OSError, ValueError):
                    pass
            self._stop()

    def __enter__(self) -> "MathVerifier":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def counters(self) -> dict[str, int]:
        return {"math_checks": self.num_checks, "math_timeouts": self.num_timeouts, "math_errors": self.num_errors}


class MathRewardFn:
    """MATH reward (async, AReaL signature): 1.0 if the completion's answer equals the reference.

    It bounds its own time (`bounds_own_time`): the verifier kills a check after `timeout_s` and this
    raises `TimeoutError`, which the RewardCaller makes a failed sample of cause `reward_timeout`
    (docs/failed-episodes.md), never a reward of 0. The caller adds no outer timeout, which would
    also count the time a check waits behind others for the verifier's worker.

    The prediction is the last non-empty `<answer>` block, else the last `\\boxed{}` of the
    completion; the reference comes from `math_reference_answer(row)`. Returns
    {"reward", "reward_right", "reward_format", "success"}: reward_format is 1.0 when an answer
    was found. `verifier` defaults to a private MathVerifier started on first use.
    """

    component_keys = ("reward_right", "reward_format", "success")
    bounds_own_time = True

    def __init__(self, verifier: MathVerifier | None = None, timeout_s: float = 10.0) -> None:
        self.verifier = verifier if verifier is not None else MathVerifier(default_timeout_s=timeout_s)
        self.timeout_s = float(timeout_s)

    @staticmethod
    def extract_prediction(completion: str) -> str | None:
        """Last non-empty `<answer>` block, else last `\\boxed{}` content, else None."""
        completion = "" if completion is None else str(completion)
        for block in reversed(extract_tag_blocks(completion, "answer")):
            if block.strip():
                return block.strip()
        boxed = last_boxed(completion)
        return boxed.strip() if boxed is not None and boxed.strip() else None

    async def __call__(self, prompt: str, completions: str, prompt_ids: Any = None, completion_ids: Any = None,
                       **row: Any) -> dict[str, float]:
        gold = math_reference_answer(row)
        pred = self.extract_prediction(completions)
        out = {"reward": 0.0, "reward_right": 0.0, "reward_format": 0.0, "success": 0.0}
        if pred is None:
            return out
        out["reward_format"] = 1.0
        verdict = await self.verifier.acheck(gold, pred, self.timeout_s)
        if verdict is None:  # not a wrong answer: unknown, so the sample fails (reward_timeout)
            raise TimeoutError(f"math-verify's check ran past {self.timeout_s:.1f}s (gold={gold:.80}, "
                               f"pred={pred:.80})")
        if verdict:
            out.update(reward=1.0, reward_right=1.0, success=1.0)
        return out

    def close(self) -> None:
        self.verifier.close()
