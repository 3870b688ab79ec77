"""Callbacks a job names by import path (`trainer.callbacks=[callback_helpers:Name]`): tests/ is on sys.path
under pytest. Each instance the job makes is kept in `MADE`, so a test can read what it saw."""
from __future__ import annotations

from rayllm_rl.callbacks import Callback

MADE: list[Callback] = []


class Recorder(Callback):
    """Keeps every record, eval and summary it is shown; stops at step `stop_at` when set."""

    stop_at: int | None = None

    def __init__(self):
        self.began, self.steps, self.evals, self.summary = [], [], [], None
        MADE.append(self)

    def on_train_begin(self, state):
        self.began.append(state)

    def on_step_end(self, record, control):
        self.steps.append(record)
        if self.stop_at is not None and record["step"] >= self.stop_at:
            control.stop(f"reached step {self.stop_at}")

    def on_evaluate(self, record, control):
        self.evals.append(record)

    def on_train_end(self, summary):
        self.summary = summary


class StopAtTwo(Recorder):
    stop_at = 2


def make_recorder() -> Recorder:
    """A factory, not a class: trainer.callbacks calls it with no arguments."""
    return Recorder()


class Unbuildable(Callback):
    def __init__(self):
        raise RuntimeError("needs a token")
