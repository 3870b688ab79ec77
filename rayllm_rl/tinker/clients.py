"""Tinker's training and sampling clients on our roles (`TinkerService` opens them): the same method names,
arguments and result types as the `tinker` SDK's, so a loop written against one runs on the other.

Every method returns an `APIFuture` at once. A training client's calls run one after another in the order they
were submitted (its `Lane`); a sampling client's samples start in order and run side by side (the engines batch
them). Sums follow Tinker: each loss is per token and summed (objectives/token_sum.py).

Versions (the driver owns them, as in our jobs): each applied `optim_step` makes the next policy version;
`save_weights_for_sampler` / `save_weights_and_get_sampling_client` send the learner's weights to every replica
over the job's transport, stamped with that version, and pin the sampling client to it. Our extension: every
sampled token carries the version that generated it, and each sequence the sampling mask the learner replays.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from tinker import types as tt

from rayllm_rl.objectives.token_sum import make_token_loss
from rayllm_rl.orchestration.backend import RoleCrashed
from rayllm_rl.tinker.data import MASK_KEYS, to_batch, to_output, to_requests, to_response
from rayllm_rl.tinker.futures import APIFuture, Lane
from rayllm_rl.sampling_mask import SamplingMask

if TYPE_CHECKING:
    from rayllm_rl.tinker.service import TinkerService


class TrainingClient:
    """One model being trained: the learner ranks of the service's roles (full fine-tuning, or a LoRA adapter of
    `lora_rank`)."""

    def __init__(self, service: "TinkerService", run_id: str, lora_rank: int):
        self.service, self.run_id, self.lora_rank = service, run_id, lora_rank
        self.model_id = f"{run_id}:train:0"
        self._lane = Lane(f"tinker-train-{run_id}")
        self._lost: str | None = None
        """Why the gradients accumulated since the last `optim_step` were dropped (a `forward_backward` that failed
        on the learner), so that the next `optim_step` fails instead of stepping on a part of them or on none."""

    # ------------------------------------------------------------------ forward / backward
    def forward(self, data: Sequence[tt.Datum], loss_fn: str,
                loss_fn_config: dict[str, float] | None = None) -> APIFuture[tt.ForwardBackwardOutput]:
        """The loss and each datum's target logprobs at the current weights; no gradient."""
        return self._lane.submit(self._run, list(data), loss_fn, loss_fn_config, False)

    def forward_backward(self, data: Sequence[tt.Datum], loss_fn: str,
                         loss_fn_config: dict[str, float] | None = None) -> APIFuture[tt.ForwardBackwardOutput]:
        """`forward`, and the loss's gradient ADDED to the parameters' (they accumulate until `optim_step`)."""
        return self._lane.submit(self._run, list(data), loss_fn, loss_fn_config, True)

    def forward_backward_custom(self, data: Sequence[tt.Datum], loss_fn: Callable[[list[tt.Datum], list[torch.Tensor]],
                                                                                    tuple[torch.Tensor, dict]]
                                ) -> APIFuture[tt.ForwardBackwardOutput]:
        """A loss of your own on the logprobs, as Tinker's SDK computes it: a forward for the logprobs, your
        `loss_fn(data, logprobs) -> (loss, metrics)` and its gradient dC/dlogp here, then a `forward_backward`
        with `cross_entropy` and weights -dC/dlogp (the same gradient through the model). `loss:sum` is your
        loss; `surrogate_loss:sum` the cross-entropy's."""
        return self._lane.submit(self._run_custom, list(data), loss_fn)

    def _run(self, data: list[tt.Datum], loss_fn: str, config, backward: bool) -> tt.ForwardBackwardOutput:
        loss = make_token_loss(loss_fn, config)
        batch, mask = to_batch(data, self.service.vocab_size)
        try:
            with self._recovering():
                logp, metrics = self.service.roles.forward_backward(batch, loss, backward, mask)
        except Exception as exc:
            if backward:
                self._lost = f"{type(exc).__name__}: {exc}"
            raise
        return to_output(logp, batch, metrics)

    @contextlib.contextmanager
    def _recovering(self):
        """A learner rank lost during the call: the roles are rebuilt and the last saved state restored
        (`TinkerService.recover`) before the call fails, so the next one works."""
        try:
            yield
        except RoleCrashed as crash:
            raise self.service.recover(crash) from crash

    def _run_custom(self, data: list[tt.Datum], loss_fn) -> tt.ForwardBackwardOutput:
        forward = self._run(data, "cross_entropy", None, False)
        logprobs = [torch.tensor(o["logprobs"].to_numpy(), requires_grad=True) for o in forward.loss_fn_outputs]
        loss, metrics = loss_fn(data, logprobs)
        loss.backward()
        if any(lp.grad is None for lp in logprobs):
            raise ValueError("forward_backward_custom: the loss did not depend on every datum's logprobs")
        linear = [tt.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"],
            **{k: d.loss_fn_inputs[k] for k in MASK_KEYS if k in d.loss_fn_inputs},
            "weights": tt.TensorData.from_numpy(-lp.grad.numpy().astype("float32"))}) for d, lp in zip(data, logprobs)]
        out = self._run(linear, "cross_entropy", None, True)
        metrics = {**out.metrics, **dict(metrics), "surrogate_loss:sum": out.metrics["loss:sum"],
                   "loss:sum": float(loss.detach().sum())}
        return tt.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type,
                                        loss_fn_outputs=out.loss_fn_outputs, metrics=metrics)

    # ------------------------------------------------------------------ optimizer
    def optim_step(self, adam_params: tt.AdamParams | None = None, *,
                   optim_params: tt.AdamParams | None = None) -> APIFuture[tt.OptimStepResponse]:
        """One AdamW step with `adam_params` (learning rate, betas, eps, weight decay, gradient-norm clip: given
        each step, Tinker's defaults where None); the gradients are cleared. An applied step makes the next policy
        version."""
        params = adam_params if adam_params is not None else optim_params
        params = params if params is not None else tt.AdamParams()
        if not isinstance(params, tt.AdamParams):
            raise TypeError(f"optim_step takes a tinker.AdamParams, got {type(params).__name__}")
        return self._lane.submit(self._optim, params.model_dump())

    def _optim(self, adam: dict[str, Any]) -> tt.OptimStepResponse:
        if self._lost is not None:
            why, self._lost = self._lost, None
            raise RuntimeError(f"optim_step: a forward_backward since the last optim_step failed ({why}); the "
                               "gradients accumulated since that step were dropped and no step was taken: submit "
                               "the data again")
        with self._recovering():
            metrics = self.service.roles.optim_step(adam)
        if not metrics.get("skipped_nonfinite_steps"):
            self.service.version += 1
        return tt.OptimStepResponse(metrics=metrics)

    # ------------------------------------------------------------------ weights for sampling, state
    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None,
                                 kind: str = "snapshot") -> APIFuture[tt.SaveWeightsForSamplerResponse]:
        """Send the learner's weights to every replica (the job's transport), stamped with the current version,
        and name that version `tinker://<run_id>/sampler_weights/<name>` (`create_sampling_client` takes it)."""
        return self._lane.submit(lambda: tt.SaveWeightsForSamplerResponse(path=self.service.publish(name, kind)))

    def save_weights_and_get_sampling_client(self, name: str | None = None, retry_config: Any = None,
                                             record_stability_info: bool = False,
                                             kind: str = "snapshot") -> "SamplingClient":
        """`save_weights_for_sampler` under a fresh name, and a sampling client pinned to that version (it can
        also be used as the future of itself: `.result()`, `await`)."""
        path = self.save_weights_for_sampler(name or self.service.fresh_name(), kind=kind).result().path
        return self.service.create_sampling_client(path)

    def save_state(self, name: str, ttl_seconds: int | None = None) -> APIFuture[tt.SaveWeightsResponse]:
        """Weights, optimizer state and counters to `tinker://<run_id>/weights/<name>`."""
        return self._lane.submit(lambda: tt.SaveWeightsResponse(path=self.service.save_state(name)))

    def load_state(self, path: str) -> APIFuture[tt.LoadWeightsResponse]:
        """The weights of a `save_state` (a `tinker://` path or its directory); a fresh optimizer."""
        return self._lane.submit(lambda: self.service.load_state(path, with_optimizer=False))

    def load_state_with_optimizer(self, path: str) -> APIFuture[tt.LoadWeightsResponse]:
        """The weights and the optimizer state of a `save_state`: the next step is the one an uninterrupted run
        would take."""
        return self._lane.submit(lambda: self.service.load_state(path, with_optimizer=True))

    def get_info(self) -> tt.GetInfoResponse:
        s = self.service
        return tt.GetInfoResponse(model_id=self.model_id, is_lora=self.lora_rank > 0, lora_rank=self.lora_rank,
                                  model_data=tt.ModelData(model_name=s.base_model, tokenizer_id=s.tokenizer_path,
                                                          arch=s.arch), model_name=s.base_model)

    def get_tokenizer(self):
        return self.service.tokenizer

    def create_sampling_client(self, model_path: str, retry_config: Any = None) -> "SamplingClient":
        return self.service.create_sampling_client(model_path)

    def close(self) -> None:
        self._lane.close()

    def result(self, timeout: float | None = None) -> "TrainingClient":
        """The client is also the future of itself (Tinker 0.38's `create_*_training_client` return one)."""
        return self


class SamplingClient:
    """Samples from the replicas at the policy version it is pinned to (`version`). A "snapshot" client samples
    while the replicas hold at most `rollout.max_staleness` versions newer (0: exactly its own), else the call
    fails naming both versions; an "inflight" client takes whatever newer weights the replicas hold. Each token's
    version says which weights generated it."""

    def __init__(self, service: "TinkerService", model_path: str, version: int, kind: str = "snapshot"):
        self.service, self.model_path, self.version, self.kind = service, model_path, version, kind

    def sample(self, prompt: tt.ModelInput, num_samples: int, sampling_params: tt.SamplingParams,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0,
               **unsupported: Any) -> APIFuture[tt.SampleResponse]:
        """`num_samples` completions of `prompt`: tokens and logprobs (of the tempered distribution the token was
        drawn from), each token's policy version and the sequence's sampling mask (`VersionedSequence`)."""
        return self.service.sampling_lane.submit(self._sample, prompt, num_samples, sampling_params,
                                                 include_prompt_logprobs, topk_prompt_logprobs, unsupported)

    def _sample(self, prompt, num_samples, params, prompt_logprobs, topk, unsupported) -> tt.SampleResponse:
        asked = sorted(k for k, v in {"topk_prompt_logprobs": topk, **unsupported}.items() if v)
        if asked:
            raise ValueError(f"sample: top-k logprobs and prompt alternatives are not implemented here ({asked})")
        if not isinstance(params, tt.SamplingParams):
            raise TypeError(f"sampling_params must be a tinker.SamplingParams, got {type(params).__name__}")
        self.service.check_serves(self)
        requests, strings = to_requests(prompt, num_samples, params, self.service.max_new_tokens)
        mask = SamplingMask(max(params.top_k, 0), params.top_p)
        response = to_response(self.service.roles.generate(requests), strings, self.service.tokenizer, mask)
        if not prompt_logprobs:
            return response
        return tt.SampleResponse(sequences=response.sequences, _prompt_logprobs_list=self._prompt_logprobs(prompt))

    def compute_logprobs(self, prompt: tt.ModelInput, prompt_logprobs_last_n: int | None = None
                         ) -> APIFuture[list[float | None]]:
        """log p(token_i | tokens_<i) of each prompt token (None for the first) at this client's version, scored by
        the learner: it holds those weights until the next `optim_step` (later, the call fails naming both
        versions)."""
        return self.service.sampling_lane.submit(self._prompt_logprobs, prompt, prompt_logprobs_last_n)

    def _prompt_logprobs(self, prompt: tt.ModelInput, last_n: int | None = None) -> list[float | None]:
        return self.service.score_prompt(self, prompt.to_ints(), last_n)

    def get_tokenizer(self):
        return self.service.tokenizer

    def get_base_model(self) -> str:
        return self.service.base_model

    # the client is also the future of itself (Tinker 0.38's `save_weights_and_get_sampling_client` returns one)
    def result(self, timeout: float | None = None) -> "SamplingClient":
        return self

    def __await__(self):
        async def itself():
            return self
        return itself().__await__()
