"""What every subcommand of the ``ckpt`` command shares about failing: the exit statuses
(0 success, 1 an error or corruption found, 2 bad usage) and ``UsageError``, for arguments that
parse but do not make sense together (ckpt/cli/main.py turns it into one line on stderr).
"""

from __future__ import annotations

from ckpt.errors import CheckpointError

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(CheckpointError):
  """Arguments that parse but do not make sense together."""
