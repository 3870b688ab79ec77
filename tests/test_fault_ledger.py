"""FaultLedger: the one place a job's restarts, re-runs, losses and checkpoint baseline are counted."""
from __future__ import annotations

import pytest

from rayllm_rl.orchestration.backend import ROLE_KINDS
from rayllm_rl.orchestration.fault_ledger import ENV_PID, LOST, RERUN, FaultLedger, role_kind


def test_collector_events_count_reruns_losses_and_env_worker_restarts():
    ledger = FaultLedger(ROLE_KINDS)
    ledger.record([(ENV_PID, 0, 100), (ENV_PID, 1, 200)])  # the collector starts: one process each
    ledger.record([(RERUN, 7), (ENV_PID, 0, 101), (RERUN, 8), (ENV_PID, 0, 101), (ENV_PID, 1, 200)])
    ledger.record([(ENV_PID, 0, 102), (LOST, 9)])
    assert ledger.env_worker_restarts() == [2, 0]  # worker 0 answered from 3 processes, a pid seen twice counts once
    out = ledger.summary()
    assert out == {"episodes_rerun": 2, "episodes_lost": 1,
                   "restarts": {**dict.fromkeys(ROLE_KINDS, 0), "env": 2}}
    ledger.replicas_restarted(2)
    assert ledger.summary()["restarts"]["inference"] == 2


def test_a_rollback_returns_losses_to_the_checkpoint_baseline_and_keeps_restarts():
    ledger = FaultLedger(ROLE_KINDS)
    ledger.record([(ENV_PID, 0, 10), (LOST, 1)])
    ledger.checkpoint_taken()  # 1 episode given up before the checkpoint: it stays lost
    ledger.record([(LOST, 5), (LOST, 6), (RERUN, 7), (ENV_PID, 0, 11)])
    assert ledger.summary()["episodes_lost"] == 3
    ledger.rolled_back(["learner-0", "env-0"])
    # the 2 lost after the checkpoint are run again by the redone steps
    assert ledger.episodes_lost == 1 and ledger.episodes_rerun == 1 + 2
    restarts = ledger.summary()["restarts"]
    assert restarts["learner"] == 1 and restarts["env"] == 1 + 1  # env-0 rebuilt once, restarted by Ray once
    # the rebuilt workers start a fresh count: their first process ids are no restarts
    ledger.record([(ENV_PID, 0, 50), (ENV_PID, 1, 51)])
    assert ledger.env_worker_restarts() == [0, 0] and ledger.summary()["restarts"]["env"] == 2
    # a second rollback with nothing lost since the (unchanged) checkpoint changes no episode count
    ledger.rolled_back(["collector"])
    assert (ledger.episodes_lost, ledger.episodes_rerun) == (1, 3)
    assert ledger.summary()["restarts"]["collector"] == 1


def test_role_kinds_and_bad_input():
    assert [role_kind(r) for r in ("env-12", "inference-0", "replay-buffer", "collector", "reference")] == [
        "env", "inference", "replay-buffer", "collector", "reference"]
    ledger = FaultLedger(["env"])
    ledger.rolled_back(["python-executor"])  # a kind the ledger was not given is added, not dropped
    assert ledger.summary()["restarts"] == {"env": 0, "python-executor": 1}
    with pytest.raises(ValueError, match="unknown fault event \\('crashed', 3\\)"):
        ledger.record([("crashed", 3)])
    with pytest.raises(ValueError, match="n >= 0"):
        ledger.replicas_restarted(-1)
