"""The trace viewer: `python -m rayllm_rl.view RUN_DIR` writes RUN_DIR/trace.html from the run directory alone."""
