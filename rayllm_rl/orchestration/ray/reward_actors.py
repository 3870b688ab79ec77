"""The reward services of `reward.*` as Ray actors, and the scorers env workers reach them through.

* `reward-model-<i>` (`RewardModelActor`): a thin shell over `rewards.reward_model.RewardModelScorer`;
  the concurrent `score` calls of every env worker are gathered into batched forwards there. With
  `reward.model.gpus_per_actor > 0` each asks Ray for that many GPUs and runs its model on the GPU.
* `judge-<i>`: an `InferenceReplica` of the judge model (the registry's engine, `reward.judge.engine`),
  frozen: it never joins the weight sync, and serves again at once when Ray restarts it.

`start_reward_actors` creates them before the env workers and waits, bounded by `trainer.call_timeout_s`,
until each has loaded its model (a job asking for GPUs the cluster lacks fails there, naming the key).
They restart like replicas (`ray.replica_restarts`); a dead one costs scores (0 and a counter), never
the run. `ray_reward_scorers` is what `make_workflow` hands `build_workflow` inside each env worker.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Mapping

import ray
import torch

from rayllm_rl.hub import resolve_model_path
from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.job.plan import JobPlan
from rayllm_rl.orchestration.ray.actors import InferenceReplica, ray_actor, ActorProcess
from rayllm_rl.orchestration.ray.groups import wait_names_free
from rayllm_rl.rewards.reward_model import RewardModelSpec, rm_sample

log = logging.getLogger(__name__)


@ray_actor
class RewardModelActor(ActorProcess):
    """`reward-model-<i>`: a sequence-classification reward model scoring batches of completions."""

    def __init__(self, spec: RewardModelSpec, timeout_s: float, num_threads: int = 1):
        """`spec`: the plan's (`JobPlan.reward_model_spec`), built on the GPU Ray gave this actor, if any."""
        torch.set_num_threads(num_threads)
        on_gpu = bool(ray.get_gpu_ids()) and torch.cuda.is_available()  # Ray's logical GPUs on CPU: the CPU
        self.timeout_s = timeout_s
        self.scorer = spec.build("cuda" if on_gpu else "cpu")

    async def score(self, samples: list[dict]) -> list[float]:
        """Scores of `samples` (`rm_sample` dicts), batched with the other calls in flight."""
        return await self.scorer.ascore(samples, self.timeout_s)

    def stats(self) -> dict[str, int]:
        """Forwards run, sequences scored, the largest batch."""
        return dataclasses.asdict(self.scorer.stats)

    def devices(self) -> dict[str, Any]:
        """The GPUs Ray gave this actor (placement.visible_devices) and the device its model is on."""
        from rayllm_rl.orchestration.ray.placement import visible_devices

        return {**visible_devices(), "device": str(self.scorer.device)}

    def close(self) -> None:
        self.scorer.close()


def start_reward_actors(plan: JobPlan, timeout_s: float | None = None, into: Any = None) -> dict[str, Any]:
    """Create the reward-model and judge actors the job's `reward.*` asks for (the roles of the plan's "services"
    phase, from their specs), and wait until each has its model (at most `timeout_s`, default
    `trainer.call_timeout_s`, for all); {} when both are off. A timeout (e.g. GPUs the cluster does not have) or a
    failed start kills them, frees their names and raises, naming the key. `into`: a `cluster.Cluster` each actor
    is recorded in as soon as it exists."""
    rc = plan.config.ray
    actors: dict[str, Any] = {}
    try:
        _create(plan, actors, into, timeout_s)
    except BaseException:
        for handle in actors.values():
            ray.kill(handle, no_restart=True)
        try:
            wait_names_free(list(actors), rc.namespace)
        except TimeoutError as exc:  # the start's own error is the one to raise
            log.warning("cleaning up the reward services' failed start: %s", exc)
        actors.clear()
        raise
    return actors


def _start_reward_model(role, section, common: dict[str, Any]):
    return RewardModelActor.options(name=role.name, num_gpus=role.actor.num_gpus, max_concurrency=1000,
                                    **common).remote(role.spec, section.timeout_s, role.actor.threads)


def _start_judge(role, section, common: dict[str, Any]):
    return InferenceReplica.options(name=role.name, num_gpus=role.actor.num_gpus, **common).remote(
        role.spec, role.actor.threads, frozen=True)


SERVICE_STARTERS = {"reward-model": (_start_reward_model, "pid", "model", "gpus_per_actor"),
                    "judge": (_start_judge, "ready", "judge", "gpus_per_replica")}
"""kind -> (its starter, the call that answers once its model is loaded, its `reward.*` section, its GPU key)."""


def _create(plan: JobPlan, actors: dict[str, Any], into: Any, timeout_s: float | None) -> None:
    cfg = plan.config
    waits: dict[str, tuple] = {}
    for role in plan.roles(phase="services"):
        start, answer, name, gpu_key = SERVICE_STARTERS[role.kind]
        section = getattr(cfg.reward, name)
        common = {"namespace": cfg.ray.namespace, "max_restarts": role.actor.restarts, "num_cpus": 0}
        actors[role.name] = handle = start(role, section, common)
        if into is not None:
            into.add(role, handle)
        waits[role.name] = (getattr(handle, answer).remote(), f"reward.{name}", section.path,
                            f"{gpu_key}={getattr(section, gpu_key):g}")
    _wait_started(waits, cfg.trainer.call_timeout_s if timeout_s is None else timeout_s)


def _wait_started(waits: dict[str, tuple], timeout_s: float) -> None:
    """Wait for every actor's first answer within one deadline; `waits`: name -> (ref, section key, model
    path, its GPU setting). The error names the actor and its keys."""
    deadline = time.monotonic() + timeout_s
    for name, (ref, key, path, gpus) in waits.items():
        try:
            ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1))
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"{name} did not start within trainer.call_timeout_s={timeout_s:g}s (raise it if this machine needs "
                f"longer; {key}.path={path!r}, {key}.{gpus}; the cluster has "
                f"GPU={ray.cluster_resources().get('GPU', 0):g} in total, "
                f"GPU={ray.available_resources().get('GPU', 0):g} free)") from None
        except ray.exceptions.RayError as exc:
            raise RuntimeError(f"{name} failed to start ({key}.path={path!r}): {exc}") from exc


class RemoteRewardModel:
    """The reward-model part as an env worker sees it: each completion goes to the least-busy
    `reward-model-<i>` actor, which batches it with the other requests in flight; bounded by `timeout_s`."""

    def __init__(self, actors: list[Any], timeout_s: float):
        if not actors:
            raise ValueError("RemoteRewardModel needs at least one reward-model actor")
        self.actors, self.timeout_s = list(actors), timeout_s
        self.in_flight = [0] * len(self.actors)

    async def score(self, prompt: str, completion: str, row: Mapping[str, Any]) -> float:
        idx = min(range(len(self.actors)), key=self.in_flight.__getitem__)
        self.in_flight[idx] += 1
        try:
            ref = self.actors[idx].score.remote([rm_sample(prompt, completion, row)])
            return (await asyncio.wait_for(ref, self.timeout_s))[0]
        finally:
            self.in_flight[idx] -= 1


def ray_reward_scorers(cfg: GRPOJobConfig) -> dict[str, Any]:
    """Inside an env worker: {"model": RemoteRewardModel, "judge": Judge over a router of the `judge-<i>`
    replicas} for the parts `cfg.reward` turns on (looked up by name, so a restarted worker finds them)."""
    from rayllm_rl.orchestration.ray.router import ReplicaRouter

    r, ns = cfg.reward, cfg.ray.namespace
    scorers: dict[str, Any] = {}
    if r.model.path:
        scorers["model"] = RemoteRewardModel([ray.get_actor(f"reward-model-{i}", namespace=ns)
                                              for i in range(r.model.num_actors)], r.model.timeout_s)
    if r.judge.path:
        from transformers import AutoTokenizer

        from rayllm_rl.rewards.judge import Judge

        router = ReplicaRouter([ray.get_actor(f"judge-{i}", namespace=ns) for i in range(r.judge.num_replicas)],
                               timeout_s=r.judge.timeout_s)
        scorers["judge"] = Judge.from_config(r.judge, router,
                                             AutoTokenizer.from_pretrained(resolve_model_path(r.judge.path)))
    return scorers


def reward_service_stats(services: Mapping[str, Any], timeout_s: float) -> dict[str, dict[str, int]]:
    """{`reward-model-<i>`: its forwards, sequences scored and largest batch}, for the run's summary."""
    models = {name: a for name, a in services.items() if name.startswith("reward-model-")}
    return dict(zip(models, ray.get([a.stats.remote() for a in models.values()], timeout=timeout_s)))


def env_worker_reward_counters(env_workers) -> dict[str, int]:
    """Reward calls, errors and timeouts summed over the env workers (`groups.ActorGroup`), for the summary."""
    total: dict[str, int] = {}
    for stats in env_workers.each(lambda w: w.stats.remote()):
        for k, v in stats.items():
            if k.startswith("reward_"):
                total[k] = total.get(k, 0) + v
    return total
