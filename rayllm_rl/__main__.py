"""`python -m rayllm_rl COMMAND ...`: the `rayllm-rl` command line (rayllm_rl/cli.py)."""
import sys

from rayllm_rl.cli import main

sys.exit(main())
