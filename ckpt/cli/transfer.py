"""``ckpt export`` and ``ckpt import``: the commands over ckpt/cli/export.py (one checkpoint to
a safetensors or npz file), ckpt/cli/orbax_export.py (to a step of an Orbax root) and ckpt/cli/convert.py (an Orbax checkpoint or safetensors files to
a step of a ckpt root), with what they report: widened dtypes, kept values, imported items.
"""

from __future__ import annotations

import ctypes
import json
import os

from ckpt.cli import convert
from ckpt.cli import integrity
from ckpt.cli.listing import open_root
from ckpt.commit import held
from ckpt.commit import steps as steps_lib
from ckpt.cli import export as export_lib
from ckpt.cli import orbax_export
from ckpt.cli.output import Progress, emit, human_bytes
from ckpt.cli.usage import EXIT_OK, UsageError
from ckpt.hf import export as hf_export


def _some(names: list[str], n: int = 4) -> str:
  shown = ", ".join(names[:n])
  return shown + (f", ... ({len(names)} in all)" if len(names) > n else "")


def cmd_export(args) -> int:
  fmt = args.to
  if fmt is None:
    ext = os.path.splitext(args.out)[1].lstrip(".")
    if ext not in export_lib.FORMATS:
      raise UsageError(f"cannot tell the format from {args.out!r}; pass "
                       "--to safetensors, --to npz or --to orbax")
    fmt = ext
  if fmt == "orbax":
    return _export_orbax(args)
  if fmt == "safetensors" and (args.max_shard_size is not None or
                               args.names is not None or
                               not args.out.endswith(".safetensors")):
    return _export_set(args)
  if args.max_shard_size is not None or args.names is not None:
    raise UsageError("--max-shard-size and --names are options of --to "
                     "safetensors into a directory")
  if args.concurrent_bytes is not None or args.compression is not None:
    raise UsageError("--concurrent-bytes and --compression are options of "
                     "--to orbax")
  with Progress(args, "export") as bar:
    report = export_lib.export(args.path, args.out, fmt, step=args.step,
                            storage_options=args.storage_options,
                            progress=bar)
  lines = [f"wrote {report.out}: step {report.step}, {report.tensors} "
           f"{'tensors' if fmt == 'safetensors' else 'arrays'}, "
           f"{human_bytes(report.bytes)}"]
  by_cast: dict[str, list[str]] = {}
  for path, cast in sorted(report.widened.items()):
    by_cast.setdefault(cast, []).append(path)
  for cast, paths in by_cast.items():
    lines.append(f"widened {len(paths)} leaves {cast} ({fmt} has no "
                 f"{cast.split('->')[0]}; exact): {_some(paths)}")
  if report.values and fmt == "safetensors":
    lines.append(f"{len(report.values)} non-array leaves kept in the header "
                 f"metadata ({convert.VALUES_KEY}): {_some(report.values)}")
  emit(args, report.to_json(), "\n".join(lines))
  return EXIT_OK


def _export_set(args) -> int:
  """``ckpt export PATH OUT_DIR --to safetensors``: a Hub-ready set."""
  if args.concurrent_bytes is not None or args.compression is not None:
    raise UsageError("--concurrent-bytes and --compression are options of "
                     "--to orbax")
  if args.storage_options:
    raise UsageError("--to safetensors into a directory reads the "
                     "checkpoint with the standard environment variables "
                     "(AWS_*, STORAGE_EMULATOR_HOST), not --storage-options")
  names = None
  if args.names is not None:
    try:
      with open(args.names, encoding="utf-8") as f:
        names = json.load(f)
    except (OSError, ValueError) as e:
      raise UsageError(f"--names {args.names}: {e}") from None
    if isinstance(names, list):
      names = [tuple(r) if isinstance(r, list) else r for r in names]
  report = hf_export.export_safetensors(
      args.path, args.out, step=args.step, names=names,
      max_shard_bytes=args.max_shard_size or 5 << 30)
  lines = [f"wrote {report.out_dir}: step {report.step}, {report.tensors} "
           f"tensors in {len(report.files)} shards, "
           f"{human_bytes(report.total_size)}"]
  if report.widened:
    lines.append(f"widened {len(report.widened)} leaves (exact): "
                 f"{_some(sorted(report.widened))}")
  if report.skipped:
    lines.append(f"left out {len(report.skipped)} leaves (no name rule "
                 f"reaches them, or not arrays): {_some(report.skipped)}")
  emit(args, report.to_json(), "\n".join(lines))
  return EXIT_OK


def cmd_detach(args) -> int:
  """``ckpt detach DIR --step N``: the step holds its own copy of every
  array it held by reference (reuse_unchanged=True on a bucket)."""
  storage = open_root(args, args.dir)
  step = args.step
  if step is None:
    step = steps_lib.committed_steps(storage)[-1:] or [None]
    step = step[0]
    if step is None:
      raise UsageError(f"{args.dir} holds no committed checkpoint")
  copied = held.detach(storage, step, lambda: integrity.verify(
      storage.url, step=step, storage_options=args.storage_options))
  text = (f"step {step}: copied " + ", ".join(
      f"{human_bytes(n)} held by step {s}" for s, n in sorted(copied.items()))
          if copied else f"step {step} holds nothing by reference")
  emit(args, {"step": step, "copied": {str(s): n for s, n in copied.items()}},
       text)
  return EXIT_OK


def _export_orbax(args) -> int:
  options = {"compression": args.compression}
  if args.concurrent_bytes is not None:
    options["concurrent_bytes"] = args.concurrent_bytes
  with Progress(args, "export") as bar:
    report = orbax_export.export_orbax(
        args.path, args.out, step=args.step,
        storage_options=args.storage_options, progress=bar, **options)
  lines = [f"wrote Orbax step {report.step_dir}: {report.arrays} arrays, "
           f"{human_bytes(report.bytes)}"
           f"{', metrics' if report.metrics else ''}",
           f"restore it with ocp.StandardCheckpointer().restore("
           f"{report.item_dir!r}, target) or ocp.CheckpointManager("
           f"{report.out!r}).restore({report.step}, "
           "args=ocp.args.StandardRestore(target))"]
  emit(args, report.to_json(), "\n".join(lines))
  return EXIT_OK


def _large_buffers_back_to_the_os() -> None:
  """glibc serves a large allocation from its heap once a freed one raised
  its mmap threshold, and keeps freed memory in per-thread arenas; the
  chunks TensorStore's threads decode are such buffers, so an import with
  a 16 MiB budget grew RSS by 130-170 MiB (200 MiB Orbax state). A fixed
  threshold (mallopt M_MMAP_THRESHOLD) maps every buffer of 1 MiB or more
  and unmaps it when freed: 55 MiB (scripts/import_memory.py). The same as
  MALLOC_MMAP_THRESHOLD_=1048576 in the environment; glibc only."""
  try:
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
  except (OSError, AttributeError):
    pass


def cmd_import(args) -> int:
  _large_buffers_back_to_the_os()
  options = {"format": args.format, "compression": args.compression}
  if args.concurrent_bytes is not None:
    options["concurrent_bytes"] = args.concurrent_bytes
  with Progress(args, "reading", unit="file") as bar:
    report = convert.import_checkpoint(
        args.src, args.dir, args.step, kind=args.source_kind, sep=args.sep,
        storage_options=args.storage_options,
        source_storage_options=args.source_storage_options,
        skip=args.skip or (), progress=bar,
        allow_sparse=args.allow_sparse, **options)
  kind = {"orbax": "Orbax checkpoint", "safetensors": "safetensors"}
  lines = [f"imported {report.leaves} leaves ({human_bytes(report.bytes)}) "
           f"from {kind[report.kind]} {report.source} as step {report.step} "
           f"of {report.directory}"]
  items = {k: v for k, v in report.items.items() if k}
  if items:
    lines.append("items: " + ", ".join(
        f"{name} ({what}{' -> step metrics' if what == 'metrics' else ''})"
        for name, what in items.items()))
  if report.host_state_processes:
    lines.append(f"host_state of {report.host_state_processes} processes "
                 "(per-process items): host_state(step) in a job of as many")
  if report.skipped:
    lines.append(f"not imported (--skip): {', '.join(report.skipped)}")
  emit(args, report.to_json(), "\n".join(lines))
  return EXIT_OK
