"""Tinker's primitives on Ray actors (issue X): the same calls as on the local backend give the same numbers, the
weights reach the replicas over the job's transport with their version, and a replica killed during a sample
fails that call, is restarted by Ray, and serves the next one at the current weights; a learner killed during a call
fails it, and every role is rebuilt from the last save_state, on which the next calls run."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tinker import types as tt

from test_tinker_primitives import datum  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def local_ray():
    from ray_sessions import JOB_ENV, local_ray_session

    with local_ray_session("test_tinker_ray", num_cpus=2, runtime_env={"env_vars": JOB_ENV}):
        yield


def test_the_primitives_on_ray_match_the_local_backend_and_survive_a_killed_replica_and_learner(local_ray,
                                                                                                  tiny_model_path,
                                                                                                  tmp_path):
    import ray

    from rayllm_rl.tinker import TinkerService

    data = [datum([5, 6, 7], [8, 9, 10], weights=[1.0, 1.0, 1.0]), datum([3, 4], [11, 12], weights=[1.0, 2.0])]
    adam = tt.AdamParams(learning_rate=1e-2)

    def three_steps(service):
        t = service.create_training_client()
        out = []
        for _ in range(3):
            out.append(t.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            step = t.optim_step(adam)
        step.result()  # the roles are read directly below, outside the client's lane
        return t, out

    with TinkerService(tiny_model_path, "local", [f"trainer.run_dir={tmp_path}"]) as local:
        local_losses = three_steps(local)[1]
        local_sum = local.roles.learner_checksum()
    overrides = [f"trainer.run_dir={tmp_path}", "ray.namespace=tinker_ray_test", "ray.num_replicas=2"]
    with TinkerService(tiny_model_path, "ray", overrides) as service:
        training, losses = three_steps(service)
        # one process each, the same kernels and seed: the same losses and weights as in this process
        assert losses == local_losses and losses[2] < losses[0]
        sampler = training.save_weights_and_get_sampling_client()
        assert service.roles.learner_checksum() == local_sum
        assert service.roles.replica_checksums() == [local_sum] * 2
        prompt = tt.ModelInput.from_ints([5, 6, 7])
        out = sampler.sample(prompt, 4, tt.SamplingParams(max_tokens=5)).result()
        assert all(set(s.versions) == {3} for s in out.sequences)

        # a replica killed while it generates: that call fails naming it, the next one is served at version 3
        replica = service.roles.cluster.replicas[0]
        pid = ray.get(replica.pid.remote(), timeout=60)  # asked while it is idle (an actor's calls queue)
        long = sampler.sample(prompt, 64, tt.SamplingParams(max_tokens=200, stop=[]))
        time.sleep(1.0)
        assert not long.done()  # the kill lands inside the call
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="inference replica \\(inference-0.*died during this call"):
            long.result(120)
        again = sampler.sample(prompt, 4, tt.SamplingParams(max_tokens=5)).result(180)
        assert all(set(s.versions) == {3} for s in again.sequences)
        assert ray.get(replica.pid.remote(), timeout=60) != pid
        assert service.roles.replica_checksums() == [local_sum] * 2
        assert service.roles.faults.summary()["restarts"]["inference"] == 1

        # a learner killed during a forward_backward: the call fails saying what was restored, every role is rebuilt
        # from the last save_state (weights and AdamW state), and the next calls work on it
        path = training.save_state("three").result(120).path
        at_save = training.forward(data, "cross_entropy").result(120).metrics["loss:sum"]
        learner_pid = ray.get(service.roles.cluster.learners[0].pid.remote(), timeout=60)  # asked while it is idle
        big = [datum(list(range(5, 200)), list(range(200, 380)), weights=[1.0] * 180)] * 48
        busy = training.forward_backward(big, "cross_entropy")
        time.sleep(1.0)
        assert not busy.done()  # the kill lands inside the call
        os.kill(learner_pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=f"learner.*died.*restored from your last save_state {path} "
                                               "\\(version 3\\)"):
            busy.result(300)
        assert training.forward(data, "cross_entropy").result(120).metrics["loss:sum"] == at_save
        assert service.roles.faults.summary()["restarts"]["learner"] == 1
        with pytest.raises(ValueError, match="no weights were saved for sampling"):
            sampler.sample(prompt, 1, tt.SamplingParams(max_tokens=2)).result(60)
        fresh = training.save_weights_and_get_sampling_client()
        assert all(set(s.versions) == {3} for s in fresh.sample(prompt, 2, tt.SamplingParams(max_tokens=4))
                   .result(120).sequences)
        assert service.roles.replica_checksums() == [local_sum] * 2
