"""The job, before anything runs: its config (`config.py`, `algo_config.py`), the task presets (`presets.py`), the
objects a user passes (`inputs.py`), the plan that validates it and makes each decision once (`plan.py`, with the
rules no decision covers in `checks.py` and the GPU layout in `placement_rules.py`), and the dry run's
description of that plan (`describe.py`, `plan_text.py`). Ray-free; the runtime is `rayllm_rl.orchestration`."""
