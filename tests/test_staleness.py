"""Bounded staleness (AReaL): StalenessController admission rule and the version-aware ReplayBuffer.

Hand cases pin the rule `accepted + running < (η + v + 1)·B`; a hypothesis property test
simulates an asynchronous system (random admissions, out-of-order finishes, rejections,
back-pressure, learner steps sampling a real ReplayBuffer) and checks the bound, the
staleness of every trained episode, conservation of episodes and liveness.
"""
from __future__ import annotations

import io
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rayllm_rl.rollout.replay_buffer import (
    ReplayBuffer,
    batch_staleness_stats,
    episode_staleness,
    min_generated_version,
)
from rayllm_rl.data.trajectory import concat_padded, make_trajectory
from rayllm_rl.rollout.staleness import StalenessController


# ------------------------------------------------------------------ helpers


def _seq(gen_versions, group_id, prompt_len=2, reward=1.0):
    """One trajectory: `prompt_len` prompt tokens (version -1) then one token per entry of
    `gen_versions` (loss_mask 1, that version)."""
    n = prompt_len + len(gen_versions)
    return make_trajectory(
        input_ids=[100 + group_id % 50 + i for i in range(n)],
        logprobs=[0.0] * prompt_len + [-0.5] * len(gen_versions),
        loss_mask=[0] * prompt_len + [1] * len(gen_versions),
        versions=[-1] * prompt_len + list(gen_versions),
        reward=reward,
        group_id=group_id,
    )


def _episode(group_id, *seqs_versions, prompt_len=2):
    """One episode (a group): one trajectory per list of generated-token versions."""
    return concat_padded([_seq(v, group_id, prompt_len) for v in seqs_versions])


# ================================================================ StalenessController


def test_sync_eta0_admits_exactly_B_per_version():
    ctl = StalenessController(batch_size=4, max_staleness=0)
    assert ctl.capacity() == 4
    assert [ctl.try_admit() for _ in range(4)] == [True] * 4
    assert ctl.try_admit() is False
    assert (ctl.running, ctl.accepted, ctl.capacity()) == (4, 0, 0)
    # finishing (accepted) does not free capacity: accepted counts until the version moves
    ctl.finish(3, accepted=True)
    assert (ctl.running, ctl.accepted) == (1, 3)
    assert ctl.capacity() == 0 and ctl.try_admit() is False
    ctl.finish()
    assert (ctl.running, ctl.accepted, ctl.capacity()) == (0, 4, 0)
    assert ctl.try_admit() is False
    ctl.set_version(1)
    assert ctl.version == 1 and ctl.capacity() == 4
    assert [ctl.try_admit() for _ in range(5)] == [True] * 4 + [False]
    st_ = ctl.stats()
    assert st_["admitted"] == 8 and st_["refused"] == 4 and st_["limit"] == 8 and st_["capacity"] == 0


def test_rejected_finish_frees_its_slot():
    ctl = StalenessController(batch_size=4, max_staleness=0)
    assert ctl.try_admit(4)
    assert not ctl.try_admit()
    ctl.finish(2, accepted=False)  # e.g. a failed episode, a group removed by a filter
    assert (ctl.running, ctl.accepted, ctl.rejected) == (2, 0, 2)
    assert ctl.capacity() == 2
    assert ctl.try_admit(2) and not ctl.try_admit()
    ctl.finish(1, accepted=True)
    assert (ctl.running, ctl.accepted, ctl.rejected, ctl.capacity()) == (3, 1, 2, 0)


def test_eta2_admits_three_batches_at_v0():
    ctl = StalenessController(batch_size=4, max_staleness=2)
    results = [ctl.try_admit() for _ in range(13)]
    assert results == [True] * 12 + [False]
    assert ctl.running == 12 and ctl.limit() == 12
    ctl.set_version(1)
    assert ctl.capacity() == 4


def test_try_admit_is_all_or_nothing():
    ctl = StalenessController(batch_size=4, max_staleness=0)
    assert ctl.try_admit(3)
    assert ctl.try_admit(2) is False
    assert ctl.running == 3  # nothing reserved by the refused call
    assert ctl.try_admit(1) and ctl.running == 4
    assert ctl.try_admit(0)  # a no-op admission always fits
    assert ctl.running == 4


def test_on_dropped_returns_slots_of_accepted_episodes():
    ctl = StalenessController(batch_size=2, max_staleness=0)
    assert ctl.try_admit(2)
    ctl.finish(2)
    assert ctl.capacity() == 0
    ctl.on_dropped(1)  # the buffer discarded one accepted episode as over-stale
    assert (ctl.accepted, ctl.dropped, ctl.capacity()) == (1, 1, 1)
    assert ctl.stats()["accepted_total"] == 2
    with pytest.raises(ValueError, match=r"on_dropped\(2\).*1"):
        ctl.on_dropped(2)


def test_max_running_caps_concurrency():
    ctl = StalenessController(batch_size=4, max_staleness=3, max_running=5)
    assert ctl.capacity() == 5
    assert ctl.try_admit(5) and not ctl.try_admit()
    ctl.finish(2)
    assert ctl.capacity() == 2  # min(16 - 2 - 3, 5 - 3)


def test_controller_validation_errors_name_the_numbers():
    with pytest.raises(ValueError, match="batch_size"):
        StalenessController(0, 1)
    with pytest.raises(ValueError, match="max_staleness.*-1"):
        StalenessController(4, -1)
    ctl = StalenessController(4, 1)
    with pytest.raises(ValueError, match="-2"):
        ctl.try_admit(-2)
    with pytest.raises(ValueError, match="-1"):
        ctl.finish(-1)
    with pytest.raises(TypeError):
        ctl.try_admit(1.5)
    with pytest.raises(TypeError):
        ctl.try_admit(True)
    assert ctl.try_admit(2)
    with pytest.raises(ValueError, match=r"finish\(3\).*2"):
        ctl.finish(3)
    assert ctl.running == 2  # the failed call changed nothing
    ctl.set_version(3)
    ctl.set_version(3)  # staying put is fine
    with pytest.raises(ValueError, match="3.*2"):
        ctl.set_version(2)
    with pytest.raises(ValueError):
        ctl.version = 1
    assert ctl.version == 3
    ctl.version = 5
    assert ctl.version == 5


def test_controller_state_dict_roundtrip():
    ctl = StalenessController(batch_size=3, max_staleness=1)
    assert ctl.try_admit(5)
    ctl.finish(3)
    ctl.finish(1, accepted=False)
    ctl.set_version(2)
    ctl.on_dropped(1)
    state = ctl.state_dict()
    other = StalenessController(batch_size=3, max_staleness=1)
    other.load_state_dict(state)
    assert (other.version, other.accepted, other.rejected, other.dropped, other.running) == (2, 2, 1, 1, 0)
    # the one still running at save time is gone after a restart, so its slot is free again
    assert other.capacity() == ctl.capacity() + 1 == (1 + 2 + 1) * 3 - 2


def test_try_admit_is_thread_safe():
    ctl = StalenessController(batch_size=50, max_staleness=1)  # 100 slots
    wins = []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        wins.append(sum(ctl.try_admit() for _ in range(60)))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(wins) == 100 == ctl.running == ctl.admitted
    assert ctl.stats()["refused"] == 8 * 60 - 100


# ================================================================ staleness helpers


def test_batch_staleness_stats_by_hand():
    td = concat_padded([
        make_trajectory([1, 2, 3, 4], [0, 0, -1, -1], [0, 0, 1, 1], [-1, -1, 3, 3], 1.0, group_id=0),
        make_trajectory([5, 6, 7], [0, -1, -1], [0, 1, 1], [-1, 1, 2], 0.0, group_id=0),
    ])
    assert td["versions"].tolist() == [[-1, -1, 3, 3], [-1, 1, 2, -1]]
    s = batch_staleness_stats(td, current_version=4)
    # lags over generated tokens: 4-3, 4-3, 4-1, 4-2 = 1, 1, 3, 2
    assert s == {"mean_lag": pytest.approx(7 / 4), "max_lag": 3, "tokens": 4}
    assert episode_staleness(td, 4) == 3  # the OLDEST generated token decides
    assert min_generated_version(td) == 1


def test_staleness_ignores_unversioned_and_non_loss_tokens():
    # a tool-output token inside the response: loss_mask 0, version -1 -> not measured
    td = make_trajectory([1, 2, 3, 4], [0, -1, 0, -1], [0, 1, 0, 1], [-1, 5, -1, 6], 0.0)
    assert batch_staleness_stats(td, 7) == {"mean_lag": 1.5, "max_lag": 2, "tokens": 2}
    assert episode_staleness(td, 7) == 2
    prompt_only = make_trajectory([1, 2], [0, 0], [0, 0], [-1, -1], 0.0)
    assert batch_staleness_stats(prompt_only, 9) == {"mean_lag": 0.0, "max_lag": 0, "tokens": 0}
    assert episode_staleness(prompt_only, 9) == 0 and min_generated_version(prompt_only) is None


# ================================================================ ReplayBuffer


def test_buffer_back_pressure_when_full():
    rb = ReplayBuffer(capacity_episodes=2, max_staleness=4)
    assert rb.put(_episode(0, [0, 0]))
    assert rb.put(_episode(1, [0]))
    assert rb.put(_episode(2, [0])) is False
    assert rb.put(_episode(3, [0])) is False
    assert len(rb) == 2
    s = rb.stats()
    assert (s["size"], s["puts"], s["rejected_full"], s["dropped_stale"], s["sampled"]) == (2, 2, 2, 0, 0)
    out = rb.sample(2, current_version=0)
    assert out["group_id"].tolist() == [0, 1]  # the refused ones were never stored
    assert len(rb) == 0
    assert rb.put(_episode(2, [0]))  # retry after the learner made room
    assert rb.stats()["puts"] == 3


def test_buffer_is_fifo_and_pads_across_episodes():
    rb = ReplayBuffer(capacity_episodes=8, max_staleness=10)
    rb.put(_episode(5, [1, 1, 1], [1]))  # two sequences, lengths 5 and 3
    rb.put(_episode(3, [2]))
    rb.put(_episode(9, [3, 3, 3, 3, 3]))  # length 7
    out = rb.sample(2, current_version=3)
    assert out["group_id"].tolist() == [5, 5, 3]
    assert out["input_ids"].shape == (3, 5)
    assert out["versions"].tolist() == [[-1, -1, 1, 1, 1], [-1, -1, 1, -1, -1], [-1, -1, 2, -1, -1]]
    assert out["loss_mask"].sum(-1).tolist() == [3, 1, 1]
    s = rb.stats()
    assert (s["sampled"], s["sampled_sequences"], s["size"]) == (2, 3, 1)
    last = rb.sample(1, current_version=3)
    assert last["group_id"].tolist() == [9] and last["input_ids"].shape == (1, 7)


def test_buffer_drops_stale_by_oldest_token():
    rb = ReplayBuffer(capacity_episodes=8, max_staleness=1)
    rb.put(_episode(0, [0, 3]))          # oldest 0: staleness 3 at v=3 -> dropped (2 gen tokens)
    rb.put(_episode(1, [2, 2]))          # staleness 1 -> kept
    rb.put(_episode(2, [1, 3], [3, 3]))  # oldest 1 although mostly new: staleness 2 -> dropped (4 tokens)
    rb.put(_episode(3, [3]))             # staleness 0 -> kept
    out = rb.sample(1, current_version=3)
    assert out["group_id"].tolist() == [1]
    s = rb.stats()
    assert (s["dropped_stale"], s["dropped_stale_sequences"], s["dropped_stale_tokens"]) == (2, 3, 6)
    assert (s["size"], s["puts"], s["sampled"]) == (1, 4, 1)
    assert s["puts"] == s["sampled"] + s["dropped_stale"] + s["size"]
    # the boundary: staleness == η is kept, η + 1 is dropped
    assert rb.drop_stale(4) == 0 and len(rb) == 1
    assert rb.drop_stale(5) == 1 and len(rb) == 0


def test_buffer_sample_returns_none_when_too_few():
    rb = ReplayBuffer(capacity_episodes=4, max_staleness=0)
    rb.put(_episode(0, [2]))
    rb.put(_episode(1, [1]))
    assert rb.sample(2, current_version=2) is None  # episode 1 is dropped, only 1 left
    assert len(rb) == 1 and rb.stats()["dropped_stale"] == 1 and rb.stats()["sampled"] == 0
    rb.put(_episode(2, [2]))
    out = rb.sample(2, current_version=2)
    assert out["group_id"].tolist() == [0, 2]


def test_buffer_without_bound_never_drops():
    rb = ReplayBuffer(capacity_episodes=2, max_staleness=None)
    rb.put(_episode(0, [0]))
    assert rb.sample(1, current_version=1000)["group_id"].tolist() == [0]
    assert rb.stats()["dropped_stale"] == 0


def test_buffer_validation():
    with pytest.raises(ValueError, match="capacity_episodes"):
        ReplayBuffer(0, 1)
    with pytest.raises(ValueError, match="max_staleness"):
        ReplayBuffer(4, -1)
    rb = ReplayBuffer(4, 1)
    with pytest.raises(TypeError):
        rb.put({"input_ids": torch.zeros(1, 2)})
    bad = _episode(0, [1])
    del bad["versions"]
    with pytest.raises(ValueError, match="versions"):
        rb.put(bad)
    with pytest.raises(ValueError, match="n_episodes"):
        rb.sample(0, 1)
    assert len(rb) == 0 and rb.stats()["puts"] == 0


def test_buffer_state_dict_roundtrip_through_torch_save():
    rb = ReplayBuffer(capacity_episodes=4, max_staleness=1)
    rb.put(_episode(7, [0]))
    rb.put(_episode(8, [2, 2], [2]))
    rb.put(_episode(9, [3]))
    assert rb.put(_episode(10, [3])) and not rb.put(_episode(11, [3]))
    rb.drop_stale(2)  # drops group 7
    buf = io.BytesIO()
    torch.save(rb.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)  # plain tensors: a checkpoint loads safely
    other = ReplayBuffer(capacity_episodes=4, max_staleness=1)
    other.load_state_dict(state)
    assert len(other) == 3 and other.stats() == rb.stats()
    a, b = rb.sample(3, 3), other.sample(3, 3)
    assert set(a.keys()) == set(b.keys())
    for k in a.keys():
        assert torch.equal(a[k], b[k]), k
    assert a["group_id"].tolist() == [8, 8, 9, 10]
    with pytest.raises(ValueError, match="3 episodes.*capacity 2"):
        ReplayBuffer(capacity_episodes=2, max_staleness=1).load_state_dict(state)


# ================================================================ property: async simulation

_ACTION = st.one_of(
    st.tuples(st.just("admit"), st.integers(1, 3)),
    st.tuples(st.just("admit_all")),
    st.tuples(st.just("finish"), st.integers(0, 63), st.sampled_from([True, True, True, False])),
    st.tuples(st.just("finish_newest")),  # leaves old episodes running: out-of-order completion
    st.tuples(st.just("finish_newest")),
    st.tuples(st.just("learn")),
    st.tuples(st.just("learn")),
)


class _AsyncSim:
    """Rollout workers, a buffer and a learner driven by an explicit event sequence."""

    def __init__(self, B, eta, buffer_capacity):
        self.B, self.eta = B, eta
        self.ctl = StalenessController(batch_size=B, max_staleness=eta)
        self.rb = ReplayBuffer(capacity_episodes=buffer_capacity, max_staleness=eta)
        self.v = 0
        self.next_gid = 0
        self.running = []  # dicts: gid, w (version at admission), n_seq, td (built at first finish)
        self.min_version = {}
        self.put_ids, self.rejected_ids, self.trained_ids = [], [], []
        self.dropped_reported = 0

    # -- events
    def admit(self, k):
        expected = self.n_accepted() + len(self.running) + k <= (self.eta + self.v + 1) * self.B
        ok = self.ctl.try_admit(k)
        assert ok == expected, (ok, k, self.ctl.stats())
        if ok:
            for _ in range(k):
                self.running.append({"gid": self.next_gid, "w": self.v, "n_seq": 1 + self.next_gid % 3, "td": None})
                self.next_gid += 1
        return ok

    def admit_all(self):
        k = self.ctl.capacity()
        return self.admit(k) if k else False

    def finish_newest(self):
        self.finish(len(self.running) - 1, True)

    def finish(self, idx, accept):
        if not self.running:
            return
        ep = self.running[idx % len(self.running)]
        if not accept:
            self.running.remove(ep)
            self.ctl.finish(1, accepted=False)
            self.rejected_ids.append(ep["gid"])
            return
        if ep["td"] is None:
            # tokens generated between admission (version w) and now (version v): the first one
            # carries w, later ones newer versions (weights swapped mid-episode)
            w, v, gid = ep["w"], self.v, ep["gid"]
            seqs = []
            for s in range(ep["n_seq"]):
                length = 1 + (gid + s) % 4
                seqs.append([w + (v - w) * j // length for j in range(length)])
            ep["td"] = _episode(gid, *seqs, prompt_len=1 + gid % 2)
            self.min_version[gid] = w
        if self.rb.put(ep["td"]):
            self.running.remove(ep)
            self.ctl.finish(1, accepted=True)
            self.put_ids.append(ep["gid"])
        else:  # back-pressure: still running (holding its slot) until the put succeeds
            assert len(self.rb) == self.rb.capacity_episodes

    def learn(self):
        before = self.rb.stats()["dropped_stale"]
        batch = self.rb.sample(self.B, self.v)
        dropped = self.rb.stats()["dropped_stale"] - before
        self.ctl.on_dropped(dropped)
        self.dropped_reported += dropped
        if batch is None:
            return False
        gids = batch["group_id"].unique().tolist()
        assert len(gids) == self.B
        for gid in gids:  # (b) no trained episode is older than η, by its oldest token
            rows = batch[batch["group_id"] == gid]
            assert self.v - min_generated_version(rows) <= self.eta, (gid, self.v, rows["versions"])
            assert self.v - self.min_version[gid] <= self.eta
        assert batch_staleness_stats(batch, self.v)["max_lag"] <= self.eta
        assert not set(gids) & set(self.trained_ids)  # nothing trained twice
        self.trained_ids.extend(gids)
        self.v += 1
        self.ctl.set_version(self.v)
        return True

    # -- checks
    def n_accepted(self):
        return len(self.put_ids) - self.dropped_reported

    def check_invariants(self):
        ctl = self.ctl
        # (a) the AReaL bound at every moment
        assert ctl.accepted + ctl.running <= (self.eta + ctl.version + 1) * self.B, ctl.stats()
        assert ctl.version == self.v and ctl.capacity() >= 0
        assert ctl.running == len(self.running)
        assert ctl.accepted == self.n_accepted()
        assert ctl.rejected == len(self.rejected_ids)
        assert ctl.admitted == len(self.put_ids) + len(self.rejected_ids) + len(self.running)
        # every accepted episode is either trained (v·B of them) or still buffered, so the free
        # slots are exactly the asynchronous slack (η+1)·B less what waits or runs: stale
        # drops give their slots back instead of silently shrinking the slack
        assert ctl.accepted == self.v * self.B + len(self.rb)
        assert ctl.capacity() == max(0, (self.eta + 1) * self.B - len(self.rb) - ctl.running), ctl.stats()
        # liveness: with nothing in flight and too little to train on, a new rollout must fit
        if ctl.running == 0 and len(self.rb) < self.B:
            assert ctl.capacity() > 0, ctl.stats()

    def check_conservation(self):
        s = self.rb.stats()
        assert s["puts"] == len(self.put_ids)
        assert s["puts"] == s["sampled"] + s["dropped_stale"] + s["size"]
        assert s["sampled"] == len(self.trained_ids) == self.v * self.B
        stored = {int(ep["group_id"][0]) for ep in self.rb.state_dict()["episodes"]}
        trained = set(self.trained_ids)
        assert len(trained) == len(self.trained_ids) and not trained & stored
        dropped = set(self.put_ids) - trained - stored
        assert len(dropped) == s["dropped_stale"] == self.ctl.dropped == self.dropped_reported
        assert trained | stored | dropped == set(self.put_ids)
        for gid in dropped:  # every drop was legitimate: over-stale by now
            assert self.v - self.min_version[gid] > self.eta
        everyone = self.put_ids + self.rejected_ids + [e["gid"] for e in self.running]
        assert sorted(everyone) == list(range(self.next_gid))  # no episode lost or duplicated


@settings(max_examples=200, deadline=None)
@given(
    B=st.integers(1, 4),
    eta=st.integers(0, 3),
    extra_capacity=st.integers(0, 3),
    actions=st.lists(_ACTION, min_size=20, max_size=50),
)
def test_async_simulation_respects_staleness(B, eta, extra_capacity, actions):
    sim = _AsyncSim(B, eta, buffer_capacity=B + extra_capacity)
    for action in actions:
        getattr(sim, action[0])(*action[1:])
        sim.check_invariants()
    sim.check_conservation()
    # drain: keep the pipeline full for a while; the learner must keep advancing
    start = sim.v
    for _ in range(3 * (eta + 2)):
        if sim.ctl.capacity():
            assert sim.admit_all()
        for ep in list(sim.running):
            sim.finish(sim.running.index(ep), True)
        sim.check_invariants()
        sim.learn()
        sim.check_invariants()
    assert sim.v >= start + 2, (start, sim.v, sim.ctl.stats(), sim.rb.stats())
    sim.check_conservation()
