"""Tinker's primitives on our roles: `forward_backward` / `optim_step` / `sample` /
`save_weights_and_get_sampling_client` over the job's learners and replicas, with Tinker's own data types as the
contract (docs/tinker-api.md).

    from rayllm_rl.tinker import TinkerService
    with TinkerService("HuggingFaceTB/SmolLM2-135M-Instruct", backend="ray") as service:
        training = service.create_training_client()
        ...

`rayllm-rl serve` puts the same service behind Tinker's wire protocol for the unmodified `tinker` SDK.
"""
from rayllm_rl.extras import require

require("rayllm_rl.tinker (Tinker's primitives, rayllm-rl serve)", "tinker")  # names the extra, not a bare ImportError

from rayllm_rl.tinker.clients import SamplingClient, TrainingClient  # noqa: E402
from rayllm_rl.tinker.data import VersionedSequence  # noqa: E402
from rayllm_rl.tinker.futures import APIFuture  # noqa: E402
from rayllm_rl.tinker.service import TinkerService  # noqa: E402

__all__ = ["APIFuture", "SamplingClient", "TinkerService", "TrainingClient", "VersionedSequence"]
