"""`rayllm-rl serve` driven by the unmodified Tinker SDK (0.38): the real server in a subprocess on the offline tiny
model (local backend), and `tinker.ServiceClient(base_url=..., api_key=...)` as a user's script would make it.

One server (and its one training client) is shared by the module's tests, in file order: an SL loop whose
cross-entropy falls, an RL step with importance_sampling on the sampler's own tokens, the REST listings, and each
bad input turned away with an error that names it. The resume test runs two servers of its own, one after the
other on one state directory; the start-up tests start servers that must refuse to run.
"""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.fixture_owned("processes")  # the module's server (and its roles) outlive each test

ROOT = Path(__file__).resolve().parents[1]
KEY = "tml-test"
START_TIMEOUT_S = 300.0
"""Opening the service (the tiny model's learner and replica) and binding: seconds on 2 cores; 300 is the bound."""
STOP_TIMEOUT_S = 120.0
RESULT_TIMEOUT_S = 300.0
"""Bound on one SDK future's `.result()`: a step of the tiny model takes well under a second."""
PROMPT = [5, 6, 7]
TEXTS = ([19, 13, 20, 31, 30, 267, 32, 21, 268, 267, 32], [11, 14, 11, 31, 30, 267, 32, 25, 268, 267, 32])
"""Two short token sequences of the tiny model's vocabulary (tokenized `a+b=<answer>c</answer>` sums)."""


class Server:
    """`python -m rayllm_rl serve MODEL ...` in `cwd`; `url` from its first stdout line; stopped with SIGTERM."""

    def __init__(self, model: str, cwd: Path, *args: str):
        self.cwd = cwd
        self.stderr = open(cwd / f"serve-{os.getpid()}-{id(self)}.err", "w+")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-m", "rayllm_rl", "serve", model, *args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_listening(self) -> str:
        """The URL of the listening line (lines before it, e.g. the Ray dashboard's under --backend ray, skipped)."""
        deadline, seen = time.monotonic() + START_TIMEOUT_S, []
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"rayllm-rl serve did not say it listens in {START_TIMEOUT_S:g} s (it printed "
                                     f"{seen}):\n{self.err()}") from None
            assert line is not None, (seen, self.err())
            if line.startswith("rayllm-rl serve: listening on http://127.0.0.1:"):
                return line.rsplit(" ", 1)[1].strip()
            seen.append(line)

    def err(self) -> str:
        if not self.stderr.closed:
            self.stderr.flush()
        return Path(self.stderr.name).read_text()[-4000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
                raise AssertionError(f"rayllm-rl serve did not stop within {STOP_TIMEOUT_S:g} s of SIGTERM")
        self.stderr.close()
        return self.proc.returncode


@contextlib.contextmanager
def serving(model: str, cwd: Path, *args: str):
    server = Server(model, cwd, "--api-key", KEY, "--state-dir", str(cwd / "state"), *args)
    try:
        url = server.wait_listening()
        yield url
    finally:
        code = server.stop()
    assert code == 0, f"rayllm-rl serve exited {code} after SIGTERM:\n{server.err()}"


@pytest.fixture(scope="module")
def served(tiny_model_path, tmp_path_factory):
    # 2 datums per forward_backward request: a batch of 4 goes as two chunks sent in parallel, first chunk last
    with serving(tiny_model_path, tmp_path_factory.mktemp("serve"), "--fwdbwd-chunk-len", "2") as url:
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        try:
            yield url, client
        finally:
            client.close("success").result(timeout=60)


@pytest.fixture(scope="module")
def trainer(served, tiny_model_path):
    _, client = served
    return client.create_lora_training_client(base_model=tiny_model_path, rank=0, seed=0).result(
        timeout=RESULT_TIMEOUT_S)


def sl_datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def sl_step(training_client, data, lr=3e-3) -> float:
    fb = training_client.forward_backward(data, "cross_entropy")
    step = training_client.optim_step(types.AdamParams(learning_rate=lr))
    loss = fb.result(timeout=RESULT_TIMEOUT_S).metrics["loss:sum"]
    step.result(timeout=RESULT_TIMEOUT_S)
    return loss


def test_sl_loop_cross_entropy_falls(trainer, tiny_model_path):
    info = trainer.get_info()
    assert info.model_data.model_name == tiny_model_path and not info.is_lora
    assert trainer.get_tokenizer().encode("1+2=") == [19, 13, 20, 31]  # tokenizer_id is the local directory
    data = [sl_datum(t) for t in TEXTS] * 2  # 4 datums: two chunks of 2, reordered by the server
    losses = [sl_step(trainer, data) for _ in range(6)]
    # plain AdamW at this lr on the tiny model: 120 -> 58 for one copy of the pair in 6 steps (measured); 0.75 leaves
    # room for the learner's own numerics while a step that did nothing (or a lost chunk) fails it
    assert losses[-1] < 0.75 * losses[0], losses
    out = trainer.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    assert [len(o["logprobs"].data) for o in out.loss_fn_outputs] == [10, 10, 10, 10]
    total = -sum(sum(o["logprobs"].data) for o in out.loss_fn_outputs)
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-4)  # summed over tokens, as Tinker's losses


def test_rl_step_with_importance_sampling(served, trainer):
    url, _ = served
    sampler = trainer.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=1)
    res = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=4, sampling_params=params).result(
        timeout=RESULT_TIMEOUT_S)
    assert len(res.sequences) == 4
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(timeout=RESULT_TIMEOUT_S)
    assert logprobs[0] is None and len(logprobs) == len(PROMPT) and all(lp < 0 for lp in logprobs[1:])
    rewards = [float(s.tokens.count(s.tokens[0])) for s in res.sequences]
    mean = sum(rewards) / len(rewards)
    data = []
    for seq, reward in zip(res.sequences, rewards):
        assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens) > 0
        tokens = PROMPT + seq.tokens
        pad = len(PROMPT) - 1
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": tokens[1:], "logprobs": [0.0] * pad + seq.logprobs,
            "advantages": [0.0] * pad + [reward - mean] * len(seq.tokens)}))
    out = trainer.forward_backward(data, "importance_sampling").result(timeout=RESULT_TIMEOUT_S)
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=RESULT_TIMEOUT_S)
    for o, seq in zip(out.loss_fn_outputs, res.sequences):
        # the learner scores the sampled tokens as the replica did (same weights: the IS ratio is 1)
        assert o["logprobs"].data[len(PROMPT) - 1:] == pytest.approx(seq.logprobs, abs=1e-2)
    # our extension, at the side endpoint: one policy version per token, the mask the learner replays
    request_id = res.sequences[0].sequence_id.rsplit(":", 1)[0]
    ext = httpx.get(f"{url}/api/v1/rayllm/samples/{request_id}", headers={"X-API-Key": KEY}, timeout=30).json()
    assert [len(s["versions"]) for s in ext["sequences"]] == [len(s.tokens) for s in res.sequences]
    assert set(ext["sequences"][0]["sampling_mask"]) == {"top_k", "top_p"}


def test_named_sampler_weights_and_the_rest_listings(served, trainer, tiny_model_path):
    url, client = served
    path = trainer.save_weights_for_sampler("named").result(timeout=RESULT_TIMEOUT_S).path
    assert path.endswith("/sampler_weights/named")
    sampler = client.create_sampling_client(model_path=path).result(timeout=RESULT_TIMEOUT_S)
    assert sampler.get_base_model() == tiny_model_path
    res = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=3)).result(
        timeout=RESULT_TIMEOUT_S)
    assert [len(s.tokens) for s in res.sequences] != [] and all(s.sequence_id for s in res.sequences)
    state = trainer.save_state("listed").result(timeout=RESULT_TIMEOUT_S).path
    rest = tinker.RestClient(base_url=url, api_key=KEY)
    run = rest.get_training_run_by_tinker_path(state).result(timeout=60)
    assert (run.base_model, run.is_lora, run.last_checkpoint.tinker_path) == (tiny_model_path, False, state)
    listed = {c.tinker_path for c in rest.list_checkpoints(run.training_run_id).result(timeout=60).checkpoints}
    assert {path, state} <= listed
    assert rest.get_weights_info_by_tinker_path(state).result(timeout=60).base_model == tiny_model_path
    rest.delete_checkpoint_from_tinker_path(path).result(timeout=60)
    assert path not in {c.tinker_path for c in rest.list_checkpoints(run.training_run_id).result(60).checkpoints}
    with pytest.raises(tinker.BadRequestError, match="was deleted"):
        client.create_sampling_client(model_path=path).result(timeout=60)


def test_unknown_loss_and_malformed_datum_fail_their_request_only(trainer):
    data = [sl_datum(TEXTS[0])]
    with pytest.raises(tinker.RequestFailedError, match="bogus_loss") as info:
        trainer.forward(data, "bogus_loss").result(timeout=RESULT_TIMEOUT_S)
    assert info.value.category == types.RequestErrorCategory.User
    short = types.Datum(model_input=types.ModelInput.from_ints(TEXTS[0][:-1]),
                        loss_fn_inputs={"target_tokens": TEXTS[0][1:-1], "weights": [1.0] * 10})
    with pytest.raises(tinker.RequestFailedError, match=r"target_tokens'\] has 9 positions but model_input has 10"):
        trainer.forward_backward([short], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    # the requests after them run (in order) as before
    assert trainer.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S).metrics["loss:sum"] > 0


def test_sampling_before_any_save_is_refused(served, trainer):
    url, client = served
    run_id = tinker.RestClient(base_url=url, api_key=KEY).get_training_run(trainer.model_id).result(
        timeout=60).training_run_id
    never = f"tinker://{run_id}/sampler_weights/never-saved"
    with pytest.raises(tinker.BadRequestError, match="never-saved"):
        client.create_sampling_client(model_path=never).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="sampling the base model .* is not supported"):
        client.create_sampling_client(base_model=trainer.get_info().model_data.model_name).result(timeout=60)


def test_a_second_model_or_a_wrong_base_model_is_refused(served, tiny_model_path):
    _, client = served
    with pytest.raises(tinker.BadRequestError, match="this server serves base model"):
        client.create_lora_training_client(base_model="/no/such/model", rank=0).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="one training client per server"):
        client.create_lora_training_client(base_model=tiny_model_path, rank=0).result(timeout=RESULT_TIMEOUT_S)


def test_bad_api_key_and_unsupported_sdk_version_are_refused(served, tiny_model_path):
    url, _ = served
    with pytest.raises(tinker.AuthenticationError, match="not the key this server was started with"):
        tinker.ServiceClient(base_url=url, api_key="tml-wrong").create_lora_training_client(
            base_model=tiny_model_path, rank=0).result(timeout=60)
    old = tinker.ServiceClient(base_url=url, api_key=KEY,
                               default_headers_overrides={"X-Stainless-Package-Version": "0.37.0"})
    with pytest.raises(tinker.BadRequestError, match=r"tinker>=0.38,<0.39; this client is tinker 0.37.0"):
        old.create_lora_training_client(base_model=tiny_model_path, rank=0).result(timeout=60)


def test_an_unimplemented_endpoint_answers_with_its_name(served, trainer):
    url, _ = served
    path = trainer.save_state("to-publish").result(timeout=RESULT_TIMEOUT_S).path
    with pytest.raises(tinker.NotFoundError, match=r"does not implement POST /api/v1/training_runs/.*/publish"):
        tinker.RestClient(base_url=url, api_key=KEY).publish_checkpoint_from_tinker_path(path).result(timeout=60)


def _ordered(arrivals: list[int], gap_timeout_s: float = 5.0) -> tuple[list[int], dict[int, object]]:
    """Submit seq_ids in `arrivals` order to a `SeqOrder`; the order they started in, and each one's outcome."""
    import asyncio

    from rayllm_rl.tinker.server.futures import FutureStore
    from rayllm_rl.tinker.server.order import SeqOrder

    started: list[int] = []

    async def main():
        store = FutureStore()
        order = SeqOrder("m", store, gap_timeout_s=gap_timeout_s)
        order.set_ready()
        ids = {}
        for seq in arrivals:
            async def start(seq=seq):
                started.append(seq)

                async def done():
                    return {"seq": seq}
                return done
            ids[seq] = order.submit(seq, "op", start)
            await asyncio.sleep(0)
        assert order.submit(arrivals[0], "op", None) == ids[arrivals[0]]  # a resent request: the same future
        outcomes = {seq: await store.wait(rid, gap_timeout_s * 3) for seq, rid in ids.items()}
        order.close()
        return {seq: (o.value if o.error is None else o.error) for seq, o in outcomes.items()}
    return started, asyncio.run(asyncio.wait_for(main(), 60))


def test_requests_run_in_seq_id_order_whatever_order_they_arrive_in():
    started, outcomes = _ordered([3, 4, 2, 1, 5])  # chunks 2..n first, the first chunk last (as the SDK sends)
    assert started == [1, 2, 3, 4, 5]
    assert outcomes == {s: {"seq": s} for s in (1, 2, 3, 4, 5)}


def test_a_seq_id_that_never_arrives_fails_the_ones_behind_it_naming_it():
    started, outcomes = _ordered([1, 3, 4], gap_timeout_s=0.5)
    assert started == [1]
    assert outcomes[1] == {"seq": 1}
    for seq in (3, 4):
        assert "seq_id 2 of model m never arrived within 0.5 s" in outcomes[seq]


def test_resume_with_optimizer_matches_an_uninterrupted_run(tiny_model_path, tmp_path):
    """save_state -> stop the server -> a new server -> create_training_client_from_state_with_optimizer: the next
    steps' losses equal those of the run that went on without stopping.

    Tolerance: both runs apply the same fp32 ops to the same weights, optimizer state and data on the same machine;
    only a reduction order may differ (thread count), each matmul output off by at most ~hidden (128) * 2**-24 =
    7.6e-6 relative, so a loss summed over 20 tokens stays within ~1e-5 relative. 1e-4 is ten times that, while a
    restore that lost the Adam moments moves the loss after one step by percents (a fresh first Adam step has
    magnitude lr per parameter, unlike the restored m/sqrt(v))."""
    data = [sl_datum(t) for t in TEXTS]
    with serving(tiny_model_path, tmp_path) as url:
        with tinker.ServiceClient(base_url=url, api_key=KEY) as client:
            tc = client.create_lora_training_client(base_model=tiny_model_path, rank=0, seed=0).result(
                timeout=RESULT_TIMEOUT_S)
            for _ in range(3):
                sl_step(tc, data)
            path = tc.save_state("resume").result(timeout=RESULT_TIMEOUT_S).path
            went_on = [sl_step(tc, data), tc.forward(data, "cross_entropy").result(RESULT_TIMEOUT_S).metrics]
    with serving(tiny_model_path, tmp_path) as url:
        with tinker.ServiceClient(base_url=url, api_key=KEY) as client:
            tc = client.create_training_client_from_state_with_optimizer(path).result(timeout=RESULT_TIMEOUT_S)
            assert tc.get_info().model_data.model_name == tiny_model_path
            resumed = [sl_step(tc, data), tc.forward(data, "cross_entropy").result(RESULT_TIMEOUT_S).metrics]
    assert resumed[0] == pytest.approx(went_on[0], rel=1e-4)  # the weights came back
    assert resumed[1]["loss:sum"] == pytest.approx(went_on[1]["loss:sum"], rel=1e-4)  # and Adam's moments


def test_serve_refuses_a_model_it_cannot_open(tmp_path):
    server = Server(str(tmp_path / "no-such-model"), tmp_path, "--api-key", KEY)
    assert server.lines.get(timeout=START_TIMEOUT_S) is None  # no listening line: it exited
    assert server.stop() == 1
    assert f"cannot serve {tmp_path / 'no-such-model'}" in server.err()
