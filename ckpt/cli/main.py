"""The ``ckpt`` command: look at, check, clean up and convert checkpoints.

  ckpt ls DIR                        steps, committed or not, size, metrics
  ckpt inspect PATH [--step S]       the tree: shapes, dtypes, chunks, sharding
  ckpt verify PATH [--step S|--all]  every stored byte against its checksum
  ckpt gc DIR --keep N [...]         what retention would delete; --yes deletes
  ckpt export PATH OUT [--to FMT]    one safetensors or npz file, or
                                     (--to orbax) a step of an Orbax root,
                                     or (--to safetensors OUT_DIR) a
                                     Hub-ready sharded set
  ckpt import SRC DIR --step S       from an Orbax checkpoint or safetensors

PATH is a checkpoint root (then ``--step``, default the latest committed) or
one step directory. Every command takes ``--json`` (one JSON document on
stdout) and ``--quiet``; progress bars go to stderr, and only when it is a
terminal. Errors are one line on stderr. Exit status: 0 success, 1 an error
or (verify) corruption found, 2 bad usage.

The command reads on the CPU (it never claims the accelerators of a machine
that is training) unless ``JAX_PLATFORMS`` says otherwise.
"""

from __future__ import annotations
import argparse
import contextlib
import json
import os
import sys
import tempfile
from typing import Sequence

from ckpt.cli import export as export_lib
from ckpt.cli.cleanup import DEFAULT_TMP_MIN_AGE_S, cmd_gc
from ckpt.cli.inspection import cmd_inspect, cmd_verify
from ckpt.cli.listing import cmd_ls
from ckpt.cli.transfer import cmd_detach, cmd_export, cmd_import
from ckpt.cli.usage import EXIT_FAIL, EXIT_OK
from ckpt.errors import CheckpointError


def _byte_size(text: str) -> int:
  """``1073741824``, ``64M``, ``1G`` (powers of 1024)."""
  units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
  t = text.strip().upper().removesuffix("IB").removesuffix("B")
  num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
  try:
    value = int(float(num) * units[unit])
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a size such as 64M or 1G, "
                                     f"got {text!r}") from None
  if value <= 0:
    raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
  return value


# ---- the parser and main -------------------------------------------------------

def _json_dict(text: str) -> dict:
  try:
    value = json.loads(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
  if not isinstance(value, dict):
    raise argparse.ArgumentTypeError("must be a JSON object")
  return value


def _non_negative(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}"
                                     ) from None
  if value < 0:
    raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
  return value


def build_parser() -> argparse.ArgumentParser:
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--json", action="store_true",
                      help="print one JSON document on stdout")
  common.add_argument("-q", "--quiet", action="store_true",
                      help="no progress bar")
  common.add_argument("--storage-options", type=_json_dict, default=None,
                      metavar="JSON",
                      help="merged into the TensorStore kvstore spec, e.g. "
                      "'{\"endpoint\": \"http://127.0.0.1:9000\"}'")
  parser = argparse.ArgumentParser(
      prog="ckpt", description="Inspect, verify, clean up and convert ckpt "
      "checkpoints.", epilog="PATH may be a checkpoint root (with --step, "
      "default latest) or one checkpoint_<step> directory; any of them may "
      "be a path, file://, gs://, s3:// URL.")
  sub = parser.add_subparsers(dest="command", required=True,
                              metavar="COMMAND")

  p = sub.add_parser("ls", parents=[common],
                     help="list the steps of a checkpoint root")
  p.add_argument("dir", metavar="DIR")
  p.add_argument("--objects", action="store_true",
                 help="object stores: count each step's objects (FILES), "
                 "from a listing of every key of every step (a request per "
                 "1,000 keys); without it ls lists only the commit records")
  p.set_defaults(func=cmd_ls)

  p = sub.add_parser("inspect", parents=[common],
                     help="show one checkpoint's tree, shapes, dtypes, "
                     "chunking, codec and saved sharding")
  p.add_argument("path", metavar="PATH")
  p.add_argument("--step", type=_non_negative)
  p.set_defaults(func=cmd_inspect)

  p = sub.add_parser("verify", parents=[common],
                     help="read every stored byte and check its crc32c; "
                     "exit 1 if any leaf is corrupt")
  p.add_argument("path", metavar="PATH")
  p.add_argument("--step", type=_non_negative)
  p.add_argument("--all", action="store_true",
                 help="verify every committed step of the root PATH")
  p.set_defaults(func=cmd_verify)

  p = sub.add_parser("gc", parents=[common],
                     help="delete what a retention policy drops, and "
                     "abandoned saves (a dry run unless --yes)")
  p.add_argument("dir", metavar="DIR")
  p.add_argument("--keep", type=int, help="keep the newest N steps (or the "
                 "N best with --best-metric); the newest is always kept")
  p.add_argument("--keep-period", type=int, metavar="P",
                 help="never delete steps divisible by P")
  p.add_argument("--best-metric", metavar="M")
  p.add_argument("--best-mode", choices=("min", "max"), default="min")
  p.add_argument("--keep-checkpoints-without-metrics",
                 action=argparse.BooleanOptionalAction, default=True)
  p.add_argument("--tmp-min-age", type=_non_negative,
                 default=DEFAULT_TMP_MIN_AGE_S, metavar="SECONDS",
                 help="remove an uncommitted checkpoint_*.tmp-* directory "
                 "only if nothing in it changed for this long, by the file "
                 "system's clock (default %(default)s; it may be a save in "
                 "progress). On a bucket: an attempt whose lease gc saw "
                 "unchanged while it watched it for this long or --lease-s, "
                 "whichever is shorter")
  p.add_argument("--lease-s", type=_non_negative, default=30,
                 metavar="SECONDS",
                 help="the writers' lease_s (default %(default)s): on a "
                 "bucket, how long at most gc watches uncommitted attempts")
  p.add_argument("--incomplete", action="store_true",
                 help="also delete incomplete step directories (no commit "
                 "marker, or no index; on a disk only) and the ones a save "
                 "set aside (checkpoint_<step>.broken-*); never without "
                 "this flag: their data may be worth recovering")
  really = p.add_mutually_exclusive_group()
  really.add_argument("--yes", action="store_true", help="really delete")
  really.add_argument("--dry-run", action="store_true",
                      help="only say what would be deleted (the default)")
  p.set_defaults(func=cmd_gc)

  p = sub.add_parser("export", parents=[common],
                     help="write one checkpoint as a safetensors or npz "
                     "file, or as a step of an Orbax CheckpointManager root")
  p.add_argument("path", metavar="PATH")
  p.add_argument("out", metavar="OUT")
  p.add_argument("--to", choices=(*export_lib.FORMATS, "orbax"),
                 help="default: from OUT's extension; orbax: OUT is an "
                 "Orbax root, written as OUT/<step>/")
  p.add_argument("--step", type=_non_negative)
  p.add_argument("--concurrent-bytes", type=_byte_size, metavar="SIZE",
                 help="--to orbax: host memory for array data in flight "
                 "(e.g. 256M; default 1G)")
  p.add_argument("--compression", choices=("zstd",),
                 help="--to orbax: compress chunks (default: raw)")
  p.add_argument("--max-shard-size", type=_byte_size, metavar="SIZE",
                 help="--to safetensors into a directory OUT (a Hub-ready "
                 "set: shards and model.safetensors.index.json): the most "
                 "bytes of one shard (e.g. 5GB, powers of 1024; default 5G)")
  p.add_argument("--names", metavar="FILE",
                 help="--to safetensors into a directory: a JSON file of the "
                 "name rules, {leaf path: key} reversed as load_safetensors' "
                 "names (a dict of key -> path, or [[regex, replacement], "
                 "...])")
  p.set_defaults(func=cmd_export)

  p = sub.add_parser("detach", parents=[common],
                     help="make one step of a bucket self-contained: copy "
                     "the arrays it holds by reference from earlier steps "
                     "(reuse_unchanged=True)")
  p.add_argument("dir", metavar="DIR")
  p.add_argument("--step", type=_non_negative, help="default: the latest")
  p.set_defaults(func=cmd_detach)

  p = sub.add_parser("import", parents=[common],
                     help="save an Orbax checkpoint (every item) or "
                     "safetensors file(s) as a step of a ckpt root")
  p.add_argument("src", metavar="SRC")
  p.add_argument("dir", metavar="DIR")
  p.add_argument("--step", type=_non_negative, required=True)
  p.add_argument("--from", dest="source_kind", default="auto",
                 choices=("auto", "orbax", "safetensors"))
  p.add_argument("--sep", default="/",
                 help="safetensors keys are split on this into nested dicts "
                 "(default '/'; '' keeps them whole)")
  p.add_argument("--format", default="zarr", choices=("zarr", "zarr3", "ocdbt"))
  p.add_argument("--compression", choices=("zstd",))
  p.add_argument("--concurrent-bytes", type=_byte_size, metavar="SIZE",
                 help="host memory for data in flight (e.g. 256M; default "
                 "1G): Orbax leaves are read box by box within it")
  p.add_argument("--source-storage-options", type=_json_dict, default=None,
                 metavar="JSON", help="like --storage-options, for SRC")
  p.add_argument("--skip", action="append", metavar="NAME",
                 help="leave out this Orbax item (or 'metrics', "
                 "'custom_metadata'); repeatable. Without it, what ckpt "
                 "cannot import is refused by name")
  p.add_argument("--allow-sparse", action="store_true",
                 help="accept Orbax arrays that claim more than 64x the "
                 "bytes the source stores (arrays of zeros Orbax did not "
                 "store); refused by default as a truncated or hostile "
                 "checkpoint")
  p.set_defaults(func=cmd_import)
  return parser


def _one_line(text: str, limit: int = 2000) -> str:
  text = " ".join(str(text).split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _setup_libraries() -> int:
  """CPU only unless JAX_PLATFORMS says otherwise; library warnings (absl:
  ckpt's and Orbax's) off, since the command reports what matters itself.
  Returns the absl verbosity to put back."""
  if "JAX_PLATFORMS" not in os.environ:
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update("jax_platforms", "cpu")
  from absl import logging  # pylint: disable=g-import-not-at-top
  before = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)
  return before


@contextlib.contextmanager
def _native_stderr_quiet():
  """Native libraries log to file descriptor 2 on their own (TensorStore's
  AWS SDK prints nine lines while it looks for credentials, before ckpt's
  own one-line error). For the command's duration, fd 2 goes to an
  unlinked temporary file, and Python's ``sys.stderr`` (ckpt's messages,
  progress bars, tracebacks) to a copy of the real one. ``CKPT_DEBUG=1``
  keeps the native lines. Only when ``sys.stderr`` is the process's own:
  a program that captured it (pytest, a caller of ``main``) keeps its own."""
  try:
    fd = sys.stderr.fileno()
  except (AttributeError, OSError, ValueError):
    fd = None
  if (fd != 2 or sys.stderr is not sys.__stderr__ or
      os.environ.get("CKPT_DEBUG")):
    yield
    return
  sys.stderr.flush()
  saved = os.dup(2)
  py = os.fdopen(os.dup(saved), "w", buffering=1, encoding=sys.stderr.encoding,
                 errors="backslashreplace")
  with tempfile.TemporaryFile() as sink:
    os.dup2(sink.fileno(), 2)
    sys.stderr = py
    try:
      yield
    finally:
      py.flush()
      sys.stderr = sys.__stderr__
      os.dup2(saved, 2)
      os.close(saved)
      py.close()


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command; returns the exit status (console-script entry)."""
  with _native_stderr_quiet():
    return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
  args = build_parser().parse_args(argv)
  from absl import logging  # pylint: disable=g-import-not-at-top
  verbosity = logging.get_verbosity()
  # set_verbosity also sets the "absl" logger's own level (it was NOTSET:
  # the level of whatever program calls main() applied); put back both.
  level = logging.get_absl_logger().level
  try:
    verbosity = _setup_libraries()
    return args.func(args)
  except KeyboardInterrupt:
    print("ckpt: interrupted", file=sys.stderr)
    return 130
  except BrokenPipeError:  # `ckpt ls | head`: stop quietly
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # so the exit flush cannot fail
    return EXIT_OK
  except (CheckpointError, OSError, ValueError, TypeError) as e:
    if os.environ.get("CKPT_DEBUG"):
      raise
    message = str(e) or type(e).__name__
    if isinstance(e, OSError) and e.filename and e.filename not in message:
      message = f"{e.filename}: {message}"
    print(f"ckpt: error: {_one_line(message)}", file=sys.stderr)
    return EXIT_FAIL
  except Exception as e:  # pylint: disable=broad-except
    if os.environ.get("CKPT_DEBUG"):
      raise
    print(f"ckpt: error: {type(e).__name__}: {_one_line(e)} (unexpected; "
          "CKPT_DEBUG=1 shows the traceback)", file=sys.stderr)
    return EXIT_FAIL
  finally:
    logging.set_verbosity(verbosity)  # main() may run inside a program
    logging.get_absl_logger().setLevel(level)
