"""How generation and training share the hardware: `make_turns` follows the job plan's placement.

* Separate placement (`SeparateTurns`): no turns. The replicas generate while the learners train
  (the asynchronous pipeline; `rollout.max_staleness` bounds how old a batch may be).
* Colocated placement (`ColocatedTurns`): learner rank i and replica i share GPU i and take turns:

      train step:  replicas sleep -> learners onload -> the step
      hand-over:   replicas wake their weights -> weight sync -> learners offload
                   -> replicas wake their KV cache (generation resumes)

  While the learner trains, vLLM has freed its memory (sleep mode); while the replica generates,
  the learner's parameters, gradients and optimizer state wait in host memory. Each actor notes
  every turn in its `turn_log()`, which the tests read to check this order.

The backend wraps its train step and weight sync in `train` and `hand_over`; nothing else branches
on the placement.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

T = TypeVar("T")


class SeparateTurns:
    """Replicas and learners on devices of their own: nothing to take turns on."""

    colocated = False

    def train(self, step: Callable[[], T]) -> T:
        return step()

    def hand_over(self, sync: Callable[[], T]) -> T:
        return sync()


class ColocatedTurns:
    """Replica i and learner rank i on one GPU: each phase waits for every actor's turn (bounded)."""

    colocated = True

    def __init__(self, cluster: Any):
        self.cluster = cluster

    def _timeout_s(self) -> float:
        return self.cluster.sync_timeout_s + 30

    def train(self, step: Callable[[], T]) -> T:
        c = self.cluster
        c.replicas.sleep(self._timeout_s())  # idempotent: SFT steps come one after another
        c.learners.onload(self._timeout_s())
        return step()

    def hand_over(self, sync: Callable[[], T]) -> T:
        c = self.cluster
        c.replicas.wake_up(["weights"], self._timeout_s())
        out = sync()
        c.learners.offload(self._timeout_s())
        c.replicas.wake_up(["kv_cache"], self._timeout_s())
        return out


def make_turns(colocated: bool, cluster: Any) -> SeparateTurns | ColocatedTurns:
    """The turns of the plan's placement: colocated pairs take turns on their GPU, separate roles do not."""
    return ColocatedTurns(cluster) if colocated else SeparateTurns()
