"""The Transformers engine in parts: generation (engine.py), its weight sink (weights.py), its turns (turns.py),
and what a job may ask of it (job.py)."""
