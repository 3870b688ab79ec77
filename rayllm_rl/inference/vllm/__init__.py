"""The vLLM engine in parts: generation and turns (engine.py), its weight sink (weights.py) and the backend in
vLLM's worker (worker.py, shadow.py, staging.py), a LoRA policy's adapter (lora.py), stopping it (shutdown.py), and
what a job may ask of it (job.py). Importing this package does not import vllm."""
