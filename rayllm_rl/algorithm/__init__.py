"""The algorithm between the rollout and the learner, Ray-free: the batch pipeline's stages
(`batch_prep.py`: reward shaping, reference KL, top-k selection, advantages, the teacher's KL, the proximal
version) and the SFT warm start before RL (`sft_warmup.py`). The job's plan builds the pipeline; the runtime
(`orchestration/`) runs it where the batch is."""
