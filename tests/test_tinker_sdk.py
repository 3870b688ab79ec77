"""The unmodified `tinker` SDK (0.38) against our server, for what needs the server's insides or a loop of its own
(tests/test_tinker_server.py has the endpoints, errors and resume): the server runs in this process on a local
`TinkerService` (uvicorn on a socket bound to port 0, in a thread), so a test can read the learner's gradients.
`rayllm-rl serve --backend ray`, its roles Ray actors, is driven through the SDK from another process by
tests/test_ray_job_submit.py (submitted as a Ray job to a local head).

- forward_backward_custom (the SDK's own client-side path: a forward, the user's loss, cross_entropy with weights
  -dC/dlogp) gives the gradient `importance_sampling` gives, within a bound derived from the arithmetic;
- examples/tinker_loop/grpo.py run unchanged through the SDK (`--base-url`): its reward rises.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import tinker
import torch

from test_tinker_primitives import EPS32, rl_data  # noqa: E402
from test_tinker_server import KEY, RESULT_TIMEOUT_S  # noqa: E402

pytestmark = pytest.mark.fixture_owned("processes")


@contextlib.contextmanager
def in_process_server(model: str, state_dir):
    """A local TinkerService behind the app, served by uvicorn in a thread; yields (url, service)."""
    import uvicorn

    from rayllm_rl.tinker import TinkerService
    from rayllm_rl.tinker.server.app import make_app
    from rayllm_rl.tinker.server.main import bind
    from rayllm_rl.tinker.server.state import expect_key

    service = TinkerService(model, "local", [f"trainer.run_dir={state_dir}"])
    sock = bind(0)
    server = uvicorn.Server(uvicorn.Config(make_app(service, expect_key(KEY), state_dir=state_dir),
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        for _ in range(300):
            if server.started:
                break
            thread.join(0.1)
        assert server.started, "uvicorn did not start within 30 s"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", service
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        service.close()
        assert not thread.is_alive(), "the in-process server did not stop within 30 s"


def test_the_sdks_forward_backward_custom_gives_the_built_in_gradient(tiny_model_path, tmp_path):
    """The same data through `importance_sampling` and through the SDK's `forward_backward_custom` with the IS
    formula as the user's loss: the learner's gradients agree to 24 * 8 float32 ulps of the largest entry (the
    custom path rounds each weight exp(logp - s) * A once more, and the logprobs cross the wire as float32: the
    same terms, summed over the 24 tokens, in the same order)."""
    with in_process_server(tiny_model_path, tmp_path) as (url, service):
        with tinker.ServiceClient(base_url=url, api_key=KEY) as client:
            training = client.create_lora_training_client(base_model=tiny_model_path, rank=0).result(
                RESULT_TIMEOUT_S)
            learner = service.roles.learner
            data = rl_data(training.get_tokenizer())
            built_in = training.forward_backward(data, "importance_sampling").result(RESULT_TIMEOUT_S)
            g_built = [p.grad.clone() for p in learner.model.parameters()]
            learner.optimizer.zero_grad(set_to_none=True)

            def is_loss(batch, logprobs):
                terms = [-(torch.exp(lp - torch.tensor(d.loss_fn_inputs["logprobs"].tolist()))
                           * torch.tensor(d.loss_fn_inputs["advantages"].tolist())).sum()
                         for d, lp in zip(batch, logprobs)]
                return torch.stack(terms).sum(), {}

            custom = training.forward_backward_custom(data, is_loss).result(RESULT_TIMEOUT_S)
            scale = max(float(g.abs().max()) for g in g_built)
            for a, b in zip(g_built, (p.grad for p in learner.model.parameters())):
                assert float((a - b).abs().max()) <= 24 * 8 * EPS32 * scale
            assert custom.metrics["loss:sum"] == pytest.approx(built_in.metrics["loss:sum"], rel=1e-5)


def test_the_example_loop_runs_unchanged_through_the_sdk_and_learns(tiny_model_path, tmp_path, monkeypatch):
    """examples/tinker_loop/grpo.py --base-url URL: the loop the primitives test runs in process, here over HTTP
    through the SDK (the server's session, futures, protobuf, seq order); its reward's last quarter exceeds the
    first by more than the run's own noise."""
    from learning_bounds import assert_rises
    from test_examples import EXAMPLES, load_module

    monkeypatch.setenv("TINKER_API_KEY", KEY)
    monkeypatch.syspath_prepend(str(EXAMPLES.parent))
    with in_process_server(tiny_model_path, tmp_path) as (url, _):
        s = load_module(EXAMPLES / "tinker_loop" / "grpo.py").main(["--base-url", url])
    k = len(s["rewards"]) // 4
    assert s["backend"] == url
    assert_rises(s["rewards"][:k], s["rewards"][-k:], what="tinker loop reward through the SDK")
