"""Forming a weight-sync setup in a test the way the driver does (`cluster.form_sync_group`).

Learner rank 0 opens its end first (`registry.open_sender`: a group transport binds its store there, on a
port the OS gives; Ray channels make their channels); the receivers are built from
`spec.with_init(opened.init)`; and rank 0 finishes its end (`opened.finish()`, where a group waits for
every receiver to join) on a thread while they join. No port is picked ahead and bound later.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

from rayllm_rl.weight_sync.registry import SyncSpec, open_sender


class OpenedInBackground:
    """Learner rank 0's end of `spec`, opened here and finished on a daemon thread.

    `spec` is what the receivers are built from (`.for_rank(k)`); :meth:`sender` waits (bounded) for the
    finished `SenderEnd` and re-raises what finishing raised."""

    def __init__(self, spec: SyncSpec, metas: Sequence[Any]):
        self.opened = open_sender(spec, metas)
        self.spec = spec.with_init(self.opened.init)
        self._box: dict = {}
        self._thread = threading.Thread(target=self._finish, name="finish-sender", daemon=True)
        self._thread.start()

    def _finish(self) -> None:
        try:
            self._box["sender"] = self.opened.finish()
        except BaseException as exc:  # noqa: BLE001 - re-raised by sender()
            self._box["error"] = exc

    def sender(self, timeout_s: float):
        """The finished sending end (a group's: once every receiver joined), waited for ≤ `timeout_s`."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise AssertionError(f"learner rank 0's {self.spec.transport} end did not finish within {timeout_s:g}s "
                                 "(did every receiver join?)")
        if "error" in self._box:
            raise self._box["error"]
        return self._box["sender"]

