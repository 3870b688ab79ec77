"""The public entry points on top of the runtime: `train(config, overrides, ...)` (`entry.py`) and TRL's front door
`GRPOTrainer(model, reward_funcs, train_dataset, callbacks)` (`trainer.py`). `from rayllm_rl import train,
GRPOTrainer` reaches both lazily."""
