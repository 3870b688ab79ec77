"""The console: one progress bar with every other line printed whole above it, constructor
arguments of restartable actors that Ray keeps in the creation task, and a clean exit after vLLM."""
from __future__ import annotations

import functools
import io
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

from rayllm_rl.orchestration.reporting import RunReporter


def shown_lines(text: str) -> list[str]:
    """What a terminal shows of each line: the text after its last carriage return."""
    return [seg.rsplit("\r", 1)[-1] for seg in text.split("\n")]


@pytest.fixture()
def console(monkeypatch):
    """A function that makes (stdout, stderr) StringIOs and a driver logger whose handler writes to that
    stderr (as `logging.basicConfig(stream=sys.stderr)` makes it: the stream is fixed when the handler is
    made). Called in the test's body: pytest sets its own sys.stdout/sys.stderr at each test phase."""
    logger = logging.getLogger("rayllm_rl.test_console")
    monkeypatch.setattr(logger, "propagate", False)
    handlers = []

    def take():
        out, err = io.StringIO(), io.StringIO()
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", err)
        handler = logging.StreamHandler(err)
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logger.addHandler(handler)
        handlers.append(handler)
        return out, err, logger, handler

    yield take
    for handler in handlers:
        logger.removeHandler(handler)


def test_log_lines_print_whole_above_the_live_bar(console, tmp_path):
    out, err, logger, handler = console()
    reporter = RunReporter(str(tmp_path))
    bar = reporter.progress(total=4, desc="grpo")
    forwarded = threading.Thread(target=lambda: [print(f"(EnvWorker pid=7) actor line {i}", file=sys.stderr)
                                                 for i in range(40)])  # Ray forwards actor output on a thread
    forwarded.start()
    for step in range(1, 5):
        bar.update(1, reward=0.5)
        bar.bar.refresh()  # draw now (the bar redraws at most once a second)
        reporter.log({"phase": "rl", "step": step, "reward": 0.25}, show=True)
        logger.warning("driver warning %d", step)
        print(f"(InferenceReplica pid=8) stderr {step}", file=sys.stderr, end="")  # a line written in two parts
        print(" continued", file=sys.stderr)
        print(f"stdout line {step}")
    forwarded.join(30)
    bar.close()

    shown = shown_lines(err.getvalue())
    expected = [f"(EnvWorker pid=7) actor line {i}" for i in range(40)]
    for step in range(1, 5):
        expected += [f"phase=rl step={step} reward=0.25", f"WARNING driver warning {step}",
                     f"(InferenceReplica pid=8) stderr {step} continued"]
    reporter_prefix = re.compile(r"^\[ *[0-9.]+s\] ")  # RunReporter's elapsed-time stamp
    whole = sorted(reporter_prefix.sub("", s) for s in shown if s and not s.startswith("grpo"))
    assert whole == sorted(expected)  # every line once, whole, nothing glued to the bar
    bars = [s for s in shown if s.startswith("grpo")]
    assert len(bars) == 1 and "4/4" in bars[0], bars  # one bar, left at its last state when closed
    assert out.getvalue().splitlines() == [f"stdout line {i}" for i in range(1, 5)]
    assert sys.stderr is err and sys.stdout is out and handler.stream is err  # the console given back


def test_one_bar_at_a_time_and_close_gives_the_console_back(console, tmp_path):
    out, err, logger, handler = console()
    from tqdm import tqdm

    reporter = RunReporter(str(tmp_path))
    first = reporter.progress(total=3, desc="first")
    first.update(1)
    second = reporter.progress(total=3, desc="second")  # a rollback starts the loop again: the old bar goes
    assert first.closed and not second.closed
    assert [b.desc for b in tqdm._instances] == ["second"]
    assert sys.stderr is not err and handler.stream is not err
    reporter.close()
    reporter.close()  # idempotent
    assert second.closed and sys.stderr is err and sys.stdout is out and handler.stream is err
    reporter.say("after the bar")
    assert shown_lines(err.getvalue())[-2] == "after the bar"


def screen(text: str) -> list[str]:
    """The lines a terminal shows after `text`: characters overwrite, "\r" goes to column 0, "\n" to the
    next line (column 0, as a tty's onlcr does), ESC[A one line up (tqdm moves between nested bars so)."""
    rows, r, c, i = [[]], 0, 0, 0
    while i < len(text):
        if text.startswith("\x1b[A", i):
            r, i = max(0, r - 1), i + 3
            continue
        ch, i = text[i], i + 1
        if ch == "\n":
            r, c = r + 1, 0
            rows += [[] for _ in range(r + 1 - len(rows))]
        elif ch == "\r":
            c = 0
        else:
            row = rows[r]
            row.extend(" " * (c + 1 - len(row)))
            row[c], c = ch, c + 1
    return [line for line in ("".join(row).rstrip() for row in rows) if line]


def test_a_library_bar_made_while_ours_is_live_draws_below_it_not_line_by_line(console, tmp_path):
    """A tqdm bar made while ours is live (datasets' "Map", a checkpoint's shards) writes to sys.stderr,
    our wrapper: every frame was printed as a line of its own above our bar."""
    from tqdm import tqdm

    out, err, logger, handler = console()
    reporter = RunReporter(str(tmp_path))
    bar = reporter.progress(total=4, desc="grpo")
    bar.update(1)
    inner = tqdm(total=30, desc="lib-map", mininterval=0)  # file=None: sys.stderr, i.e. our wrapper
    for i in range(30):
        inner.update(1)
        if i % 10 == 9:
            logger.warning("driver warning %d", i)
    inner.close()
    reporter.log({"phase": "rl", "step": 2, "reward": 0.5}, show=True)
    bar.update(3)
    bar.close()
    shown = screen(err.getvalue())
    assert len([s for s in shown if s.startswith("lib-map")]) == 1, shown  # its last state, left as tqdm leaves it
    assert "30/30" in next(s for s in shown if s.startswith("lib-map"))
    assert [s for s in shown if s.startswith("WARNING")] == [f"WARNING driver warning {i}" for i in (9, 19, 29)]
    assert [s for s in shown if s.startswith("grpo")] == [next(s for s in shown if "4/4" in s)]  # one bar, at 4/4
    assert len(shown) == 6, shown  # 3 warnings, the reporter's line, the library's bar, ours
    assert sys.stderr is err and handler.stream is err


def test_a_handler_that_follows_sys_stderr_is_left_alone(console, tmp_path):
    """dill (imported by datasets) logs through logging's _StderrHandler, whose `stream` is a property that
    reads sys.stderr at each record: it cannot be given a stream (setStream raised AttributeError when
    every gsm8k job started its bar) and needs none, as it writes to our wrapper while the bar is live."""
    import datasets  # noqa: F401 - imports dill, which adds the handler

    dill_logger = logging.getLogger("dill")
    assert any(type(h).__name__ == "_StderrHandler" for h in dill_logger.handlers)
    out, err, logger, handler = console()
    reporter = RunReporter(str(tmp_path))
    bar = reporter.progress(total=2, desc="grpo")
    bar.update(1)
    dill_logger.warning("from dill")
    bar.update(1)
    reporter.close()
    shown = screen(err.getvalue())
    assert shown.count("from dill") == 1 and [s for s in shown if s.startswith("grpo")] == [shown[-1]]
    assert sys.stderr is err and handler.stream is err


@pytest.mark.parametrize("first_closed", ["a", "b"])
def test_two_live_reporters_give_the_real_console_back(console, tmp_path, first_closed):
    """A second reporter's bar and streams wrap the real console, not the first one's wrapper, and
    both closed in either order leave sys.stderr, sys.stdout and the handler on the real streams."""
    out, err, logger, handler = console()
    a, b = RunReporter(str(tmp_path / "a")), RunReporter(str(tmp_path / "b"))
    pa = a.progress(total=2, desc="first")
    pb = b.progress(total=2, desc="second")
    assert pb.bar.fp._wrapped is err and sys.stderr.stream is err and handler.stream.stream is err
    logger.warning("while both are live")
    print("stdout while both are live")
    pa.update(2)
    pb.update(2)
    for r in ((a, b) if first_closed == "a" else (b, a)):
        r.close()
    assert sys.stderr is err and sys.stdout is out and handler.stream is err, (sys.stderr, handler.stream)
    shown = screen(err.getvalue())
    assert shown.count("WARNING while both are live") == 1 and pa.bar.fp._wrapped is err
    assert out.getvalue() == "stdout while both are live\n"


def test_train_turns_the_hf_progress_bars_off_and_back_on(tmp_path, monkeypatch, capsys):
    """A gsm8k job's task build runs datasets' "Map" and "Flattening the indices" on the driver: no bar
    on the console from them. The job stops at loading the model (a directory with only config.json)."""
    import datasets
    import huggingface_hub.utils as hub_utils

    from fixtures.hub_cache import GSM8K_FIXTURE, go_offline
    from rayllm_rl import train

    go_offline(tmp_path, monkeypatch)  # a fresh datasets cache: the maps run, not read from an old cache
    model = tmp_path / "config-only"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, '
                                       '"num_hidden_layers": 2, "num_attention_heads": 4, '
                                       '"num_key_value_heads": 2, "vocab_size": 1000}')
    datasets.enable_progress_bars()
    hub_utils.enable_progress_bars()
    with pytest.raises(OSError, match="config-only"):
        train(None, ["task=gsm8k", f"data.path={GSM8K_FIXTURE}", f"model.path={model}", "trainer.backend=local",
                     f"trainer.run_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert list((tmp_path / "hf_home" / "datasets").rglob("cache-*.arrow"))  # the task was built: .map ran
    assert "examples/s" not in err and "Map" not in err and "Flattening" not in err, err[-2000:]
    assert datasets.is_progress_bar_enabled() and not hub_utils.are_progress_bars_disabled()  # put back


def test_restartable_actor_arguments_must_be_inlined(tiny_model_path):
    from ray import cloudpickle

    from rayllm_rl.config import load_config
    from rayllm_rl.orchestration.ray.cluster import INLINE_LIMIT_BYTES, check_inlined
    from rayllm_rl.job.config import GRPOJobConfig
    from rayllm_rl.orchestration.factories import build_task
    from rayllm_rl.orchestration.ray.backend import make_workflow

    cfg = load_config(GRPOJobConfig, []).validate()
    factory = functools.partial(make_workflow, cfg, tiny_model_path, build_task(cfg).worker_part())
    assert len(cloudpickle.dumps(factory)) < INLINE_LIMIT_BYTES // 4  # the env worker's factory: well inside
    check_inlined("env worker", (factory, ["inference-0"], "replay-buffer", "ns", None, 60.0, 1))
    with pytest.raises(ValueError, match=r"env worker: constructor argument 1 \(bytes\) pickles to 2000\d\d bytes"):
        check_inlined("env worker", (factory, b"x" * 200_000))


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_process_exits_clean(tiny_model_path, tmp_path, request):
    """An engine closed with `aclose` leaves no AsyncLLM for interpreter shutdown, whose `__del__`
    would then fail ("Exception ignored in AsyncLLM.__del__ ... 'NoneType' object is not callable")."""
    script = tmp_path / "engine_exit.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, gc, weakref
        from rayllm_rl.inference.protocol import LLMRequest, SamplingParams
        from rayllm_rl.inference.vllm.engine import VLLMEngine, VLLMOptions

        async def main():
            engine = VLLMEngine({tiny_model_path!r}, options=VLLMOptions(kv_cache_mb=64))
            await engine.start()
            out = await engine.agenerate(LLMRequest(input_ids=[1, 2, 3],
                                                    sampling=SamplingParams(max_new_tokens=4, ignore_eos=True)))
            llm = weakref.ref(engine.llm)
            await engine.aclose()
            await engine.aclose()  # idempotent
            engine.shutdown()
            gc.collect()
            print("generated", out.output_len, "alive", llm() is not None)

        if __name__ == "__main__":
            asyncio.run(main())
    """))
    # The engine's temp dir, for vLLM's zmq sockets and its gloo file store (short: a socket path must fit sun_path)
    temp = Path(tempfile.mkdtemp(prefix="/tmp/ve-"))
    request.addfinalizer(lambda: shutil.rmtree(temp, ignore_errors=True))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1], env={**os.environ, "TMPDIR": str(temp)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generated 4 alive False" in proc.stdout, proc.stdout[-2000:]
    # torch's compile cache (torchinductor_<user>) is shared by design and meant to persist
    left = sorted(p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_"))
    assert left == [], f"the engine left these in its temp dir: {left}"
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
