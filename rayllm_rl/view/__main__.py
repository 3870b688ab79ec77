"""`python -m rayllm_rl.view RUN_DIR`: write RUN_DIR/trace.html (self-contained; open it in any browser)."""
from __future__ import annotations

import argparse
import sys

from rayllm_rl.view.page import write_page


def main(argv: list[str] | None = None, prog: str = "python -m rayllm_rl.view") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("run_dir", help="a run directory (it holds traces.jsonl and metrics.jsonl)")
    args = parser.parse_args(argv)
    try:
        path = write_page(args.run_dir)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path.resolve().as_uri())
    return 0


if __name__ == "__main__":
    sys.exit(main())
