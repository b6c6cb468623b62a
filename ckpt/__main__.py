"""``python -m ckpt``: the ckpt command (see ckpt/cli.py)."""

import sys

from ckpt.cli import main

if __name__ == "__main__":
  sys.exit(main())
