"""`TinkerService`: Tinker's primitives on the job's own roles. It makes the job's plan of a learner and its
replicas alone (`JobPlan.only("learner", "replica")`) from a config, so they are built as a job builds them, by
the backend the config names (`trainer.backend`: local = this process, ray = named Ray actors); it owns the policy
version (the driver's, as in our jobs), the saved paths and the sampling lane.

    service = TinkerService("path/or/hub-id", backend="ray")
    training = service.create_lora_training_client(rank=8)        # or create_training_client() (full)
    training.forward_backward(data, "importance_sampling")
    training.optim_step(tinker.AdamParams(learning_rate=1e-5))
    sampler = training.save_weights_and_get_sampling_client()
    sampler.sample(prompt, 4, tinker.SamplingParams(max_tokens=32)).result()
"""
from __future__ import annotations

import itertools
import threading
import uuid
from pathlib import Path
from typing import Any, Sequence

from tinker import types as tt

from rayllm_rl.tinker.clients import SamplingClient, TrainingClient
from rayllm_rl.tinker.futures import Lane

SCHEME = "tinker://"
SERVICE_DEFAULTS = ("rollout.temperature=1.0", "rollout.max_staleness=0", "trainer.run_dir=runs/tinker",
                    "ray.num_replicas=1")
"""Where a Tinker loop differs from a job's defaults: the learner scores at temperature 1 (Tinker's logprobs),
a sampling client serves only its own version, saves go under runs/tinker, one replica; each can be overridden."""
SAMPLING_LANE_THREADS = 64
"""Sample calls run side by side (one thread each while it waits on the replicas)."""


def plan_of(argv: list[str]):
    """The job's plan of `argv` (`key.sub=value` items) with its learners and replicas alone: the job's own
    validation, so a wrong value fails naming its key before any role starts."""
    from rayllm_rl.config import load_config
    from rayllm_rl.job.config import GRPOJobConfig
    from rayllm_rl.job.inputs import JobInputs
    from rayllm_rl.job.plan import make_plan

    cfg = load_config(GRPOJobConfig, argv)
    return make_plan(cfg, JobInputs.of(cfg)).only("learner", "replica")


class TinkerService:
    """The roles of one base model and what a Tinker client needs of them. `overrides` are the job's
    `key.sub=value` settings (e.g. `optim.max_tokens_per_micro_batch=4096`, `ray.num_replicas=2`,
    `inference.engine=vllm`); `trainer.backend` is `backend`."""

    def __init__(self, model_path: str, backend: str = "local", overrides: Sequence[str] = ()):
        self.base_model, self.backend = model_path, backend
        self._argv = [*SERVICE_DEFAULTS, f"model.path={model_path}", f"trainer.backend={backend}", *overrides]
        plan = plan_of(self._argv)  # a config error fails here, before anything starts
        self.config = plan.config
        self._owns_runtime = plan.primitives_class().prepare(self.config)
        """Whether this service started the backend's runtime (a local Ray), which its roles stop on close."""
        self.roles: Any = None
        self.training_client: TrainingClient | None = None
        self.version, self.synced = 0, None
        """The learner's policy version (applied optimizer steps); the version the replicas hold (None: none sent
        yet, so there is nothing to sample from)."""
        self.last_state: str | None = None
        """The path of the last `save_state`, which a rebuild after a lost learner restores (`recover`)."""
        self._resync = False
        """A `load_state` changed the learner's weights under a version the replicas may already hold."""
        self.samplers: dict[str, tuple[int, str]] = {}
        """`tinker://` sampler path -> (its version, its kind)."""
        self.sampling_lane = Lane("tinker-sample", SAMPLING_LANE_THREADS)
        self._names = itertools.count()
        self._lock = threading.Lock()
        self.max_new_tokens = self.config.rollout.max_new_tokens

    # ------------------------------------------------------------------ clients
    def create_training_client(self, lora_rank: int = 0, seed: int | None = None) -> TrainingClient:
        """Start the roles (a learner of `lora_rank`, 0 = every weight trains) and return the one training client
        of this service."""
        from transformers import AutoConfig, AutoTokenizer

        from rayllm_rl.hub import resolve_model_path

        if self.training_client is not None:
            raise ValueError(f"this service already trains {self.training_client.model_id}; one training client per "
                             "service (start another service for another model)")
        if not isinstance(lora_rank, int) or lora_rank < 0:
            raise ValueError(f"lora rank must be an int >= 0 (0 = full fine-tuning), got {lora_rank!r}")
        argv = [*self._argv, f"model.lora.rank={lora_rank}", *([f"trainer.seed={seed}"] if seed is not None else [])]
        plan = plan_of(argv)
        self.config = plan.config
        path = resolve_model_path(self.config.model.path, self.config.model.revision)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        model_cfg = AutoConfig.from_pretrained(path)
        self.tokenizer_path, self.arch = path, (model_cfg.architectures or ["unknown"])[0]
        self.vocab_size = int(model_cfg.vocab_size)
        self.roles = plan.primitives_class()(plan, path, owns_runtime=self._owns_runtime)
        self.run_id = uuid.uuid4().hex[:12]
        self.state_root = Path(self.config.trainer.run_dir).resolve() / self.run_id
        self.training_client = TrainingClient(self, self.run_id, lora_rank)
        return self.training_client

    def create_lora_training_client(self, base_model: str | None = None, rank: int = 32, seed: int | None = None,
                                    **_targets: Any) -> TrainingClient:
        """Tinker's name: a LoRA adapter of `rank` on this service's model (`train_mlp` / `train_attn` /
        `train_unembed` are `model.lora.target_modules` here)."""
        if base_model not in (None, self.base_model):
            raise ValueError(f"this service serves {self.base_model!r}, not {base_model!r}")
        return self.create_training_client(rank, seed)

    def create_sampling_client(self, model_path: str) -> SamplingClient:
        """A client pinned to the version a `save_weights_for_sampler` named `model_path`."""
        if model_path not in self.samplers:
            raise ValueError(f"unknown sampler weights {model_path!r}: save_weights_for_sampler returns the paths "
                             f"this service serves ({sorted(self.samplers) or 'none saved yet'})")
        version, kind = self.samplers[model_path]
        return SamplingClient(self, model_path, version, kind)

    # ------------------------------------------------------------------ versions and weights
    def fresh_name(self) -> str:
        return f"step-{self.version}-{next(self._names)}"

    def publish(self, name: str, kind: str) -> str:
        """Sync the learner's weights to the replicas if they hold an older version; name the version."""
        if kind not in ("snapshot", "inflight"):
            raise ValueError(f"kind must be 'snapshot' or 'inflight', got {kind!r}")
        self._require_training()
        if self.synced != self.version or self._resync:
            self.roles.sync_weights(self.version)
            self.synced, self._resync = self.version, False
        path = f"{SCHEME}{self.run_id}/sampler_weights/{name}"
        self.samplers[path] = (self.version, kind)
        return path

    def check_serves(self, client: SamplingClient) -> None:
        """Refuse a sample the replicas cannot give at the client's version (see `SamplingClient`)."""
        held, eta = self.synced, self.config.rollout.max_staleness
        if held is None:
            raise ValueError("sample: no weights were saved for sampling yet (save_weights_for_sampler or "
                             "save_weights_and_get_sampling_client first)")
        if client.kind == "snapshot" and held - client.version > eta:
            raise ValueError(f"sample: this sampling client is pinned to policy version {client.version}; the "
                             f"replicas hold version {held}, more than rollout.max_staleness={eta} newer. Get a new "
                             "sampling client, or one of kind='inflight'")

    def score_prompt(self, client: SamplingClient, tokens: list[int], last_n: int | None) -> list[float | None]:
        """Prompt logprobs at the client's version, on the learner (which holds it until the next step)."""
        from rayllm_rl.objectives.token_sum import CrossEntropy
        from rayllm_rl.tinker.data import to_batch

        if self.version != client.version:
            raise ValueError(f"compute_logprobs: the learner holds policy version {self.version}, not this sampling "
                             f"client's {client.version}; score before the next optim_step")
        if len(tokens) < 2:
            return [None] * len(tokens)
        datum = tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                         loss_fn_inputs={"target_tokens": tt.TensorData(data=tokens[1:], dtype="int64")})
        batch, mask = to_batch([datum], self.vocab_size)
        logp, _ = self.roles.forward_backward(batch, CrossEntropy(), False, mask)
        out = [None, *(float(x) for x in logp[0, :len(tokens) - 1])]
        return out if last_n is None else [None] * (len(out) - last_n) + out[-last_n:]

    # ------------------------------------------------------------------ state
    def tinker_path(self, kind: str, name: str) -> str:
        return f"{SCHEME}{self.run_id}/{kind}/{name}"

    def local_path(self, path: str) -> Path:
        """The directory of a `tinker://<run>/<kind>/<name>` path this machine wrote (any run under the service's
        run_dir), or a local directory given as it is."""
        if path.startswith(SCHEME):
            run, _, rest = path[len(SCHEME):].partition("/")
            return self.state_root.parent / run / rest
        return Path(path)

    def save_state(self, name: str) -> str:
        self._require_training()
        path = self.tinker_path("weights", name)
        self.roles.save_state(str(self.local_path(path)), {"version": self.version, "base_model": self.base_model,
                                                          "lora_rank": self.training_client.lora_rank})
        self.last_state = path
        return path

    def recover(self, crash: BaseException) -> RuntimeError:
        """After a learner rank died (`RoleCrashed`): every role rebuilt, the last `save_state` (weights and
        optimizer) loaded into it, or the base weights at version 0 if there was none; returns the error the failed
        call raises, saying so. The next call runs on the restored state."""
        self.roles.recover(crash)
        self.synced, self._resync = None, True
        if self.last_state is None:
            self.version = 0
            where = "no save_state was made, so it restarted from the base weights at version 0"
        else:
            self.load_state(self.last_state, with_optimizer=True)
            where = f"restored from your last save_state {self.last_state} (version {self.version})"
        cause = type(crash.__cause__).__name__ if crash.__cause__ is not None else "died"
        return RuntimeError(f"role(s) {', '.join(getattr(crash, 'roles', []))} died during this call ({cause}); "
                            f"every role was rebuilt and {where}; save weights for sampling again before the next "
                            "sample")

    def load_state(self, path: str, with_optimizer: bool) -> tt.LoadWeightsResponse:
        self._require_training()
        where = self.local_path(path)
        if not where.is_dir():
            raise ValueError(f"load_state: {path!r} is not a saved state here (no directory {where})")
        extra = self.roles.load_state(str(where), with_optimizer)
        if extra.get("base_model") not in (None, self.base_model):
            raise ValueError(f"load_state: {path!r} was trained from {extra['base_model']!r}, not {self.base_model!r}")
        self.version, self._resync = int(extra.get("version", 0)), True
        return tt.LoadWeightsResponse(path=path, model_id=self.training_client.model_id)

    def _require_training(self) -> None:
        if self.roles is None:
            raise ValueError("no training client yet: create_training_client / create_lora_training_client first")

    def close(self) -> None:
        """Let running calls finish, then stop the roles (and a Ray this service started)."""
        if self.training_client is not None:
            self.training_client.close()
        self.sampling_lane.close()
        if self.roles is not None:
            self.roles.close()
            self.roles = None

    def __enter__(self) -> "TinkerService":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

