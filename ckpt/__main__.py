"""``python -m ckpt``: the ckpt command (see ckpt/cli/main.py)."""

import sys

from ckpt.cli.main import main

if __name__ == "__main__":
  sys.exit(main())
