"""The ckpt demo: a multi-process sharded save, restored on other layouts.

``./scripts/demo`` runs this file. With no ``CKPT_CLUSTER`` in the
environment it is the driver: it starts real ``jax.distributed`` jobs on this
machine through ``ckpt.multihost.local_cluster`` (each process is this same file, run
as a worker) and prints a summary:

1. 2 processes x 4 CPU devices build a random, sharded, training-state-like
   PyTree (params, Adam mu and nu, step; about 330 MB) and save it as step 1
   with ``async_save=False`` (timed), then save step 2 asynchronously and
   report how long ``save`` blocked.
2. 4 processes x 2 devices restore step 1 onto another mesh and other
   PartitionSpecs and check every shard bit for bit.
3. 1 process x 8 devices restores step 2 (the async save) onto a third mesh
   and checks it the same way.

Every process regenerates the same global arrays from fixed seeds, so each
can check what it holds without talking to the others.

Usage: python scripts/demo.py [--dir ./out/demo] [--layers 3] [--width 768]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import time
from typing import Any

import numpy as np

from ckpt.multihost import local_cluster

SCRIPTS = pathlib.Path(__file__).resolve().parent
MB = 1e6
GB = 1e9

# name -> (shape as a function of width, save spec, 4x2 spec, 1x8 spec).
# The save mesh is ("data", "model") = 2 x 4; the 4 x 2 restore mesh is
# ("fsdp", "tp") = 2 x 4 laid over 4 processes; the 1 x 8 mesh is ("x",).
_LAYER = {
    "attn/qkv": (lambda d: (d, 3 * d), ("data", "model"), ("tp", "fsdp"), (None, "x")),
    "attn/out": (lambda d: (d, d), ("model", "data"), (("fsdp", "tp"), None), ("x", None)),
    "mlp/up": (lambda d: (d, 4 * d), (None, "model"), ("fsdp", "tp"), ("x", None)),
    "mlp/down": (lambda d: (4 * d, d), ("model", None), (None, ("fsdp", "tp")), (None, "x")),
    "norm/scale": (lambda d: (d,), (), ("tp",), ()),
}
_EMBED = (lambda d: (8192, d), ("model", "data"), ("tp", "fsdp"), ("x", None))


def param_specs(layers: int, width: int) -> dict[str, tuple]:
  """Parameter path (inside params/mu/nu) -> (shape, save, 4x2, 1x8 specs)."""
  out = {"embed/table": (_EMBED[0](width),) + _EMBED[1:]}
  for i in range(layers):
    for name, (shape, *specs) in _LAYER.items():
      out[f"layers/{i}/{name}"] = (shape(width), *specs)
  return out


def leaf_paths(specs: dict[str, tuple]) -> list[str]:
  return [f"{group}/{p}" for group in ("params", "opt/mu", "opt/nu")
          for p in specs]


def _spec_of(specs: dict[str, tuple], path: str) -> tuple:
  """The spec of "params/<p>", "opt/mu/<p>" or "opt/nu/<p>"."""
  return specs[path.split("/", 2)[2] if path.startswith("opt/")
               else path.split("/", 1)[1]]


def global_value(path: str, shape: tuple[int, ...]) -> np.ndarray:
  """The global array of one leaf: the same on every process (fixed seed)."""
  seed = sum(ord(c) * 31**i for i, c in enumerate(path)) % 2**32
  return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


# ---- worker (one process of a local jax.distributed job) --------------------


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
  """{"a/b": x} -> {"a": {"b": x}}."""
  from ckpt.format import tree  # pylint: disable=g-import-not-at-top
  return tree.nest({tuple(path.split("/")): v for path, v in flat.items()})


def _state(specs, leaf) -> dict[str, Any]:
  """{"params", "opt": {"mu", "nu", "count"}, "step"} with leaf(path, spec)."""
  flat = {path: leaf(path, _spec_of(specs, path)) for path in leaf_paths(specs)}
  state = _nest(flat)
  state["opt"]["count"] = leaf("opt/count", None)
  state["step"] = leaf("step", None)
  return state


STEP_VALUE = 1000  # the state's "step" and "opt/count"
# Per process layout: mesh axes, mesh shape, which spec column of the table.
MESHES = {"2x4": (("data", "model"), (2, 4), 1),
          "4x2": (("fsdp", "tp"), (2, 4), 2),
          "1x8": (("x",), (8,), 3)}


def worker(config: dict) -> dict:
  """One process of a job: ``config["op"]`` is "save" or "restore"."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top

  specs = param_specs(config["layers"], config["width"])
  layout = f"{jax.process_count()}x{jax.local_device_count()}"
  axes, mesh_shape, col = MESHES[layout]
  mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), axes)
  out: dict[str, Any] = {"process": jax.process_index(), "layout": layout}

  def sharding(spec) -> NamedSharding:
    return NamedSharding(mesh, P(*spec[col]) if spec else P())

  if config["op"] == "save":
    def leaf(path, spec):
      if path == "step":
        return STEP_VALUE
      if spec is None:  # opt/count: a replicated int32 scalar
        return jax.device_put(np.int32(STEP_VALUE), sharding(None))
      value = global_value(path, spec[0])
      return jax.make_array_from_callback(value.shape, sharding(spec),
                                          lambda i: value[i])

    state = _state(specs, leaf)
    jax.block_until_ready(state)
    out["state_bytes"] = int(sum(x.nbytes for x in jax.tree.leaves(state)
                                 if isinstance(x, jax.Array)))
    out["leaves"] = len(jax.tree.leaves(state))
    with ckpt.Checkpointer(config["dir"], async_save=False) as ckptr:
      multihost.barrier("demo/save/start", what="start of the timed save")
      t0 = time.perf_counter()
      ckptr.save(1, state)
      out["save_s"] = time.perf_counter() - t0
      out["bytes_written"] = ckptr.last_save_stats.bytes_written
      out["boxes_written"] = ckptr.last_save_stats.boxes_written
    with ckpt.Checkpointer(config["dir"], async_save=True) as ckptr:
      multihost.barrier("demo/async/start", what="start of the async save")
      t0 = time.perf_counter()
      ckptr.save(2, state)
      out["async_blocking_s"] = ckptr.last_save_stats.blocking_s
      ckptr.wait_until_finished()
      out["async_total_s"] = time.perf_counter() - t0
      out["steps"] = ckptr.all_steps()
    return out

  def target_leaf(path, spec):
    if path == "step":
      return 0
    if spec is None:
      return jax.ShapeDtypeStruct((), np.int32, sharding=sharding(None))
    return jax.ShapeDtypeStruct(spec[0], np.float32, sharding=sharding(spec))

  target = _state(specs, target_leaf)
  with ckpt.Checkpointer(config["dir"]) as ckptr:
    multihost.barrier("demo/restore/start", what="start of the restore")
    t0 = time.perf_counter()
    restored = ckptr.restore(config["step"], target=target)
    jax.block_until_ready(restored)
    out["restore_s"] = time.perf_counter() - t0
  # Verify: every addressable shard, bit for bit, against the global arrays.
  mismatches, shards, read = [], 0, 0
  flat = {"/".join(str(getattr(k, "key", k)) for k in kp): x
          for kp, x in jax.tree_util.tree_flatten_with_path(restored)[0]}
  for path in leaf_paths(specs):
    x, truth = flat[path], global_value(path, _spec_of(specs, path)[0])
    boxes = {}  # distinct boxes this process holds: what it read
    for s in x.addressable_shards:
      shards += 1
      if not np.array_equal(np.asarray(s.data).view(np.uint32),
                            truth[s.index].view(np.uint32)):
        mismatches.append(f"{path} {s.index}")
      boxes[str(s.index)] = s.data.nbytes
    read += sum(boxes.values())
  for path in ("opt/count", "step"):
    if int(np.asarray(flat[path])) != STEP_VALUE:
      mismatches.append(f"{path}: {flat[path]} != {STEP_VALUE}")
  out.update(mismatches=mismatches, shards_checked=shards, bytes_read=read,
             leaves_checked=len(flat))
  return out


# ---- driver -----------------------------------------------------------------


def _run(config: dict, n: int, k: int, timeout_s: float) -> list[dict]:
  results = local_cluster.run(
      "demo", config, num_processes=n, devices_per_process=k,
      timeout_s=timeout_s, cwd=str(SCRIPTS))
  return local_cluster.check(results)


def _disk(step_dir: pathlib.Path) -> tuple[int, int]:
  files = [p for p in step_dir.rglob("*") if p.is_file()]
  return len(files), sum(p.stat().st_size for p in files)


def _mb(n: float) -> str:
  return f"{n / MB:,.1f} MB"


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dir", default=os.environ.get("CKPT_DEMO_DIR",
                                                      "out/demo"),
                      help="checkpoint directory: new, empty, or made by an "
                      "earlier demo run (whose checkpoints are replaced)")
  parser.add_argument("--layers", type=int, default=3)
  parser.add_argument("--width", type=int, default=768)
  parser.add_argument("--timeout", type=float, default=300.0,
                      help="seconds each local job may take")
  args = parser.parse_args()
  if args.width % 8:
    parser.error("--width must be a multiple of 8")
  directory = pathlib.Path(args.dir).resolve()
  marker = directory / ".ckpt-demo"
  if directory.exists() and any(directory.iterdir()) and not marker.exists():
    parser.error(f"{directory} is not empty and was not made by the demo; "
                 "pass an empty or new --dir")
  directory.mkdir(parents=True, exist_ok=True)
  marker.touch()
  for old in directory.glob("checkpoint_*"):  # the previous demo run's
    shutil.rmtree(old)
  config = {"dir": str(directory), "layers": args.layers, "width": args.width}
  t_start = time.perf_counter()

  print(f"ckpt demo: local jax.distributed jobs on 127.0.0.1, checkpoints in "
        f"{directory}")
  save = _run({**config, "op": "save"}, 2, 4, args.timeout)
  state_bytes = save[0]["state_bytes"]
  n_params = sum(np.prod(s[0]) for s in param_specs(args.layers, args.width).values())
  print(f"\nstate: {save[0]['leaves']} leaves, {_mb(state_bytes)} float32 "
        f"(params {_mb(n_params * 4)} = {n_params / 1e6:.1f}M parameters, "
        f"Adam mu and nu the same, plus step and count)")
  save_s = max(r["save_s"] for r in save)
  print("\nsave step 1: 2 processes x 4 devices, mesh data=2 x model=4, "
        "format zarr, async_save=False")
  for r in save:
    print(f"  process {r['process']}: wrote {_mb(r['bytes_written'])} "
          f"({r['bytes_written'] / state_bytes:.0%}) in {r['boxes_written']} "
          f"boxes, {r['save_s']:.2f} s")
  step_dir = directory / "checkpoint_1"
  files, disk = _disk(step_dir)
  example = step_dir / "params/layers/0/attn/qkv"
  chunks = sorted(p.name for p in example.iterdir())
  print(f"  on disk: checkpoint_1/ holds {files} files, {_mb(disk)}: "
        f"index.msgpack ({(step_dir / 'index.msgpack').stat().st_size:,} "
        f"bytes) and one zarr array per leaf, e.g. "
        f"params/layers/0/attn/qkv/ = {', '.join(chunks[:4])}"
        f"{', ...' if len(chunks) > 4 else ''} ({len(chunks)} files)")
  print(f"  save time {save_s:.2f} s -> {state_bytes / save_s / GB:.2f} GB/s")
  blocking = max(r["async_blocking_s"] for r in save)
  total = max(r["async_total_s"] for r in save)
  print(f"\nsave step 2 with async_save=True: save() blocked {blocking:.2f} s "
        f"(device -> host staging), committed after {total:.2f} s; "
        f"steps on disk: {save[0]['steps']}")

  for step, (n, k), mesh in ((1, (4, 2), "fsdp=2 x tp=4"), (2, (1, 8), "x=8")):
    res = _run({**config, "op": "restore", "step": step}, n, k, args.timeout)
    restore_s = max(r["restore_s"] for r in res)
    print(f"\nrestore step {step}: {n} process{'es' if n > 1 else ''} x {k} "
          f"devices, mesh {mesh}, other PartitionSpecs")
    for r in res:
      print(f"  process {r['process']}: read {_mb(r['bytes_read'])} in "
            f"{r['restore_s']:.2f} s")
    print(f"  restore time {restore_s:.2f} s -> "
          f"{state_bytes / restore_s / GB:.2f} GB/s")
    bad = [m for r in res for m in r["mismatches"]]
    shards = sum(r["shards_checked"] for r in res)
    if bad:
      print(f"  VERIFY FAILED: {len(bad)} mismatches: {bad[:10]}")
      return 1
    print(f"  verified: {res[0]['leaves_checked']} leaves, {shards} shards "
          "bit-exact against the saved arrays")
  print(f"\ndemo finished in {time.perf_counter() - t_start:.1f} s")
  return 0


if __name__ == "__main__":
  if local_cluster.ENV_CONFIG in os.environ:
    local_cluster.init_from_env()
    local_cluster.write_result(worker(json.loads(sys.argv[1])))
  else:
    sys.exit(main())
