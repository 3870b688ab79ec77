"""Ray actor shells: each a thin `@ray.remote` class over a plain, Ray-free component.

Names on the dashboard: `inference-<i>`, `env-<i>`, `learner-<rank>`, `collector`, `replay-buffer`,
the frozen models (`FrozenActor`: `reference` only with a reference-KL term, `teacher` only with `teacher.path`);
`collector` and `replay-buffer` are in rollout_actors.py, `reward-model-<i>` and `judge-<i>` (with `reward.*`) in
reward_actors.py.

Every actor process starts with `ACTOR_ENV_VARS` (no HF progress bars: Ray forwards actor output to
the driver's console). A restartable actor (env worker, inference replica, teacher) takes only small
arguments that Ray inlines in its creation task, and looks other actors up by name: Ray re-runs
the constructor with the same arguments on a restart, and arguments held in the object store may
be gone by then (ray-project/ray#53727).
"""
from __future__ import annotations

import asyncio
import time
import warnings
from typing import Any

import ray
import torch

from rayllm_rl.hub import resolve_model_path
from rayllm_rl.inference.protocol import LLMRequest, LLMResponse, weights_checksum
from rayllm_rl.orchestration.ray.actor_env import ACTOR_ENV_VARS
from rayllm_rl.orchestration.ray.router import ReplicaNotReady, ReplicaRouter


def ray_actor(cls=None, **options):
    """`@ray.remote` for the job's actor classes: no CPU reserved (placement decides), `ACTOR_ENV_VARS`
    (`JobEnvActorClass`); `options`: more of `ray.remote`'s (e.g. `enable_tensor_transport`)."""
    if cls is None:
        return lambda c: ray_actor(c, **options)
    return JobEnvActorClass(ray.remote(num_cpus=0, **options)(cls))


def job_sets_actor_env() -> bool:
    """Whether the job's own runtime env already gives every actor `ACTOR_ENV_VARS` (a local Ray this package
    starts does: `session.local_init_kwargs`; a job submitted with them in its runtime env does too)."""
    job_vars = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
    return all(job_vars.get(k) == v for k, v in ACTOR_ENV_VARS.items())


class JobEnvActorClass:
    """A Ray actor class whose actors get `ACTOR_ENV_VARS`: from the job's runtime env when it sets them, else as
    the actor's own runtime env. An actor with a runtime env of its own gets a fresh worker process started for
    it, never one of the job's idle workers: 5 actors took ~10 s to answer that way against ~3 s here (2 cores),
    and every job start, restart and rollback starts 5 or more."""

    def __init__(self, remote_class):
        self._remote_class = remote_class

    def options(self, **options):
        if "runtime_env" not in options and not job_sets_actor_env():
            options["runtime_env"] = {"env_vars": dict(ACTOR_ENV_VARS)}
        return self._remote_class.options(**options)

    def remote(self, *args, **kwargs):
        return self.options().remote(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._remote_class, name)


class ActorProcess:
    """Mixed into every actor: its process id, for fault-injection tests and operators, and its turn
    log (colocated placement: when it slept, trained, handed weights over, woke)."""

    def pid(self) -> int:
        import os

        return os.getpid()

    def _turn(self, event: str) -> None:
        """Note `event` at `time.monotonic()` (one clock for every process of a node)."""
        log = self.__dict__.setdefault("_turns", [])
        log.append((event, time.monotonic()))
        del log[:-TURN_LOG_LEN]

    def turn_log(self) -> list[tuple[str, float]]:
        """The last `TURN_LOG_LEN` turn events `(event, time.monotonic())`, oldest first."""
        return list(self.__dict__.get("_turns", []))


TURN_LOG_LEN = 4096

CLOSE_GROUP_S = 60.0
"""Bound on leaving the weight-sync group at close when the replica never joined one (else ray.sync_timeout_s)."""


@ray_actor(enable_tensor_transport=True)  # receives weights over Ray Direct Transport (rdt_* transports)
class InferenceReplica(ActorProcess):
    """`inference-<i>`: an engine (Transformers or vLLM) and the weight sink it owns.

    The replica never touches engine tensors: weights arrive through the engine's sink, `engine.weights`
    (`init_update_group`, `receive_weights`), whatever the engine keeps inside; sleep goes to `engine.turns`.
    """

    def __init__(self, spec, num_threads: int = 1, frozen: bool = False):
        """`spec`: the engine's `inference.registry.EngineSpec` (the plan's, or a judge's); `frozen`: weights
        never synced (a judge's `judge-<i>`), so a restarted process serves at once."""
        torch.set_num_threads(num_threads)
        self.engine = spec.build()
        self.versions_held = [self.engine.version]  # every version this replica ever generated with
        with warnings.catch_warnings():  # Ray's own property reads its deprecated `actor_id` inside
            warnings.simplefilter("ignore")
            self.serving = frozen or not ray.get_runtime_context().was_current_actor_reconstructed
        """False in a process Ray restarted after a crash (unless frozen), until the current weights arrive: it refuses
        requests (the router waits or goes elsewhere) instead of generating with the checkpoint's weights."""
        self._sync_timeout_s: float | None = None
        """`ray.sync_timeout_s`, from the spec of the weight-sync group this replica joined (None: not joined)."""

    async def ready(self) -> int:
        """Start the engine (vLLM spawns its engine core here) on the actor's event loop."""
        await self.engine.start()
        return self.engine.version

    async def agenerate(self, request: LLMRequest) -> LLMResponse:
        if not self.serving:
            raise ReplicaNotReady("this replica was restarted and has not received the current weights yet")
        out = await self.engine.agenerate(request)
        self._turn("generated")
        return out

    async def sleep(self, level: int = 1) -> None:
        """Free the engine's GPU memory while the learner sharing the GPU trains (colocated); requests
        wait until `wake_up` has brought everything back."""
        await self.engine.turns.sleep(level)
        self._turn("sleep")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """`tags`: "weights" (before a weight sync), "kv_cache" (then generation resumes); None = both."""
        await self.engine.turns.wake_up(tags)
        self._turn("wake:" + "+".join(tags or ["all"]))

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def receiving_processes(self, transport) -> int:
        """How many processes of this replica receive over `transport` (the ranks it takes)."""
        return self.engine.weights.receiving_processes(transport)

    async def init_update_group(self, spec) -> bool:
        """Build the engine's receiving end(s) of the weight sync (`weight_sync.registry.SyncSpec`)."""
        await self.engine.weights.init_update_group(spec)
        self._sync_timeout_s = spec.timeout_s
        return True

    async def receive_weights(self, published: dict | list | None = None) -> dict[str, float]:
        """Receive while generating, then swap in between two decode steps (the engine's sink).
        `published`: learner rank 0's `send_weights` result, for a transport whose receivers fetch
        what it published (it holds references only): resolved by Ray before this call, or passed as
        `[reference]` (`cluster.handoff_arg`) and awaited here, so that Ray schedules this call while
        rank 0 is still publishing (bounded by `ray.sync_timeout_s`, naming the phase)."""
        if isinstance(published, list):
            timeout = self._sync_timeout_s
            if timeout is None:
                raise RuntimeError("receive_weights: init_update_group was not called on this replica")
            try:
                published = await asyncio.wait_for(published[0], timeout)
            except asyncio.TimeoutError as exc:
                raise TimeoutError("weight sync: learner rank 0 did not publish within "
                                   f"ray.sync_timeout_s={timeout:g}s (phase: handoff)") from exc
        out = await self.engine.weights.receive_weights(None if published is None else published["handoff"])
        if published is not None:  # rank 0's send figures: the driver cannot take a Ray Direct Transport result
            out = {**out, "sent": published["stats"]}
        self._turn("weights received")
        self.versions_held.append(int(out["version"]))
        self.serving = True
        return out

    async def leave_update_group(self) -> None:
        """Leave the weight-sync group (it is formed again after a replica restarted)."""
        await self.engine.weights.close_update_group()

    def version_history(self) -> list[int]:
        return list(self.versions_held)

    async def checksum(self) -> float:
        return await self.engine.weights.weights_checksum()

    async def close(self) -> None:
        """Leave the sync group, then stop the engine whatever leaving did: vLLM unlinks its shared-memory queues
        only when it stops itself, and the job kills this process next."""
        try:
            await asyncio.wait_for(self.engine.weights.close_update_group(), self._sync_timeout_s or CLOSE_GROUP_S)
        except Exception as exc:  # noqa: BLE001 - still stop the engine
            warnings.warn(f"leaving the weight-sync group on close: {type(exc).__name__}: {exc}", RuntimeWarning)
        finally:
            await self.engine.aclose()


@ray_actor
class EnvWorker(ActorProcess):
    """Runs many workflow episodes concurrently against the replicas and puts each finished episode
    straight into the replay buffer (the collector only admits work; it never carries episodes)."""

    def __init__(self, workflow_factory, replica_names: list[str], buffer_name: str, namespace: str,
                 episode_filter=None, timeout_s: float = 300.0, num_threads: int = 1, failures=None):
        """Names, not handles: Ray re-runs this constructor on a restart with the creation task's
        arguments, and counts an actor handle among them as an object-store reference (it logs an
        error for it at creation). `workflow_factory` is a small picklable callable that builds the
        episode workflow here; `failures`: the plan's `rollout.failures.FailurePolicy` (None: the default)."""
        torch.set_num_threads(num_threads)
        self.workflow = workflow_factory()
        self.router = ReplicaRouter([ray.get_actor(n, namespace=namespace) for n in replica_names], timeout_s=timeout_s)
        self.buffer = ray.get_actor(buffer_name, namespace=namespace)
        self.episode_filter = episode_filter
        self.failures = failures
        self.timeout_s = timeout_s
        self.episodes = 0

    async def run_episode(self, row: dict) -> Any:
        """Run one episode and store it in the buffer (unless filtered); returns its `EpisodeOutcome`."""
        from rayllm_rl.rollout.collector import run_and_store

        self.episodes += 1
        return await run_and_store(self.workflow, self.router, row, self._put, self.episode_filter, self.failures)

    async def _put(self, td) -> None:
        episode_id = int(td["group_id"][0])  # the collector's id of this episode (all rows share it)
        await asyncio.wait_for(self.buffer.put.remote(td, self.timeout_s, episode_id), self.timeout_s + 30)

    def stats(self) -> dict[str, Any]:
        from rayllm_rl.workflows.rewards import workflow_reward_counters

        return {"episodes": self.episodes, **workflow_reward_counters(self.workflow)}


@ray_actor
class FrozenActor(ActorProcess):
    """A frozen model on the dashboard under its name (`reference`, `teacher`): a `learner.frozen.FrozenModel`
    scoring the sampled tokens of a batch. One loaded from its own path holds nothing a restart loses: Ray restarts it
    (its spec's `restarts`), it loads the path again, and the buffer scores the batch again (`score_with_restarts`)."""

    def __init__(self, spec, policy_path: str = "", weights: dict[str, torch.Tensor] | str | None = None,
                 num_threads: int = 1):
        """`spec`: one of the plan's `JobPlan.frozen`; a model started from the policy gets `policy_path` and
        `weights`: the policy's tensors (the driver passes learner rank 0's result by reference: Ray fetches it
        here), or a checkpoint directory holding them (`learner.frozen.weights_file`)."""
        torch.set_num_threads(num_threads)
        # a GPU share of learner rank 0's bundle (placement.py): that GPU, in the learner's dtype; else the CPU
        on_gpu = bool(ray.get_gpu_ids()) and torch.cuda.is_available()
        self.name = spec.name
        self.model = spec.build(policy_path=policy_path, weights=weights, device="cuda" if on_gpu else "cpu")

    def compute_logprobs(self, batch) -> torch.Tensor:
        return self.model.compute_logprobs(batch)

    def save(self, checkpoint_dir: str) -> str:
        return self.model.save(checkpoint_dir, self.name)


@ray_actor(enable_tensor_transport=True)  # rank 0 sends weights over Ray Direct Transport (rdt_* transports)
class LearnerWorker(ActorProcess):
    """One FSDP rank of the learner; rank 0 also streams weights to the replicas."""

    def __init__(self, rank: int, world_size: int, num_threads: int = 1):
        torch.set_num_threads(num_threads)
        self.rank, self.world_size = rank, world_size
        self.learner = None
        self.sender = None
        self._opened = None  # learner rank 0's weight-sync end, opened and not yet finished
        self._store = None  # rank 0's FSDP rendezvous store, bound by `rendezvous` until `setup` takes it

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def rendezvous(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0: bind the FSDP group's store on a port the OS gives and return (node ip, that port), which
        every rank's `setup` is handed (no port is picked ahead); port 0 for a single rank (no group)."""
        ip = ray.util.get_node_ip_address()
        if self.world_size == 1:
            return ip, 0
        from rayllm_rl.rendezvous import listen_store

        self._store = listen_store(ip, self.world_size, timeout_s)
        return ip, int(self._store.port)

    def setup(self, spec, loss, master_addr: str, master_port: int) -> bool:
        """Build this rank's `Learner` from `spec` (`learner.LearnerSpec`), training with `loss` (the plan's)."""
        from rayllm_rl.learner.distributed import DistConfig

        store, self._store = self._store, None
        dist = DistConfig(rank=self.rank, world_size=self.world_size, master_addr=master_addr, master_port=master_port,
                          backend="nccl" if spec.use_gpu else "gloo",
                          store=store) if self.world_size > 1 or spec.use_gpu else None
        self.learner = spec.build(dist)
        self.loss = loss
        return True

    def train_step(self, batch, loss=None) -> dict[str, float]:
        self._turn("train start")
        out = self.learner.train_step(batch, loss if loss is not None else self.loss)
        self._turn("train end")
        return {**out, "trace": self.learner.trace} if self.learner.trace else out

    def forward_backward(self, batch, loss, backward: bool, sampling_mask):
        """Tinker's step on this rank (`learner.primitives`): (logprobs [N, T], metrics); gradients accumulate."""
        from rayllm_rl.learner import primitives

        return primitives.forward_backward(self.learner, batch, loss, backward=backward, sampling_mask=sampling_mask)

    def optim_step(self, adam) -> dict[str, float]:
        """Apply the accumulated gradients with this step's Adam parameters (`learner.primitives.optim_step`)."""
        from rayllm_rl.learner import primitives

        return primitives.optim_step(self.learner, adam)

    def offload(self) -> int:
        """Training state off the GPU (colocated, while the replica sharing it generates); bytes moved."""
        moved = self.learner.offload()
        self._turn("offload")
        return moved

    def onload(self) -> int:
        """Training state back on the GPU before a train step; bytes moved."""
        moved = self.learner.onload()
        self._turn("onload")
        return moved

    def reset_optimizer(self, optim) -> None:
        self.learner.reset_optimizer(optim)

    def open_weight_sender(self, spec):
        """Rank 0 opens the sending end of `spec` (`weight_sync.registry.SyncSpec`): a group transport binds
        its store here on a port the OS gives. Returns the init info the receivers are built from."""
        from rayllm_rl.weight_sync.registry import open_sender

        self.close()  # an earlier end (the group forms again after a replica restart)
        self._opened = open_sender(spec, self.learner.weight_metas())
        return self._opened.init

    def finish_weight_sender(self) -> bool:
        """Rank 0 completes the end it opened; a group transport waits here (≤ its timeout) for every
        receiver to join, so the driver calls it while the replicas join."""
        opened, self._opened = self._opened, None
        if opened is None:
            raise RuntimeError("finish_weight_sender: no sending end was opened (open_weight_sender first)")
        self.sender = opened.finish()
        return True

    def weight_metadata(self) -> tuple:
        """`(name, shape, dtype)` of every tensor a sync sends, in send order (no gather needed)."""
        from rayllm_rl.weight_sync import metas_to_spec

        return metas_to_spec(self.learner.weight_metas())

    def close(self) -> None:
        """Release the sending end: its group, segments or published objects (before the actor is killed)."""
        opened, self._opened = self._opened, None
        if opened is not None:
            opened.close()
        if self.sender is not None:
            self.sender.close()
        self.sender = None

    def send_weights(self, version: int) -> dict[str, Any]:
        """Every rank gathers full tensors in step; rank 0 sends them. Its result carries the
        transport's handoff (references, tensors Ray moves, or None), which the driver passes to the
        replicas, and the send's figures (`stats`: bytes, seconds, bytes/s), read from the same result: by the
        driver, or, with Ray Direct Transport (whose result only the replicas can take), echoed by a replica."""
        tensors = self.learner.iter_named_tensors()
        if self.rank != 0:
            for _ in tensors:
                pass
            return {}
        stats, handoff = self.sender.send(tensors, version)
        return {"handoff": handoff,
                "stats": {"sync_bytes": stats.bytes, "sync_s": stats.seconds, "sync_bytes_per_s": stats.bytes_per_s}}

    def policy_weights(self) -> dict[str, torch.Tensor]:
        """The full weights in host memory, for a frozen model started from the policy (Ray hands it this result by
        reference); every rank must call it (an FSDP gather), non-zero ranks' copies are dropped."""
        full = {}
        for name, t in self.learner.iter_named_tensors():  # every rank joins each gather; rank 0 keeps a copy
            if self.rank == 0:
                full[name] = t.detach().cpu()
        return full

    def checksum(self) -> float:
        return weights_checksum(self.learner.named_tensors())

    def save_checkpoint(self, path: str, tokenizer_path: str | None, extra: dict) -> str:
        from transformers import AutoTokenizer

        from rayllm_rl.learner.checkpoint import save_checkpoint

        tok = (AutoTokenizer.from_pretrained(resolve_model_path(tokenizer_path))
               if tokenizer_path and self.rank == 0 else None)
        save_checkpoint(self.learner, path, tokenizer=tok, extra=extra)
        return path

    def load_checkpoint(self, path: str) -> dict:
        from rayllm_rl.learner.checkpoint import load_checkpoint

        return load_checkpoint(self.learner, path)
