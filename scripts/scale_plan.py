"""Scale harness, part 1: what planning a save costs ONE host of a big job.

A simulated job of D devices, 4 per process, on a mesh
(data, fsdp, tensor) with tensor = 4 (inside a host) and fsdp up to 256,
and a transformer-like state of L leaves: attention and MLP kernels sharded
over (fsdp, tensor), biases over tensor, norms and small tables replicated
on every device, each with two optimizer moments. One process (in the middle
of the job) plans its share with exactly the code a save runs
(``placement.named`` -> ``plan.leaf_layout`` -> ``plan.assign_writes``, and
then the index entries ``save.plan_save`` makes: ``with_entries_cpu_s``), from a ``MeshInfo`` describing
the whole job: this machine has 8 devices, not 16,384, but planning never
touches a device.

Each (D, L) runs in a fresh process: CPU time of planning (not wall time:
other work on the machine does not inflate it), peak resident memory
growth during planning, the writes this host gets, and the size of the
index process 0 would write.

  python -m scripts.scale_plan [--config configs/scale.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from scripts.benchlib import measure
from ckpt.format import entries as entries_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

D_MODEL = 8192
# (name, shape, spec, dtype): one layer's parameters.
LAYER = [
    ("attn/q", (D_MODEL, D_MODEL), ("fsdp", "tensor"), "float32"),
    ("attn/k", (D_MODEL, D_MODEL), ("fsdp", "tensor"), "float32"),
    ("attn/v", (D_MODEL, D_MODEL), ("fsdp", "tensor"), "float32"),
    ("attn/o", (D_MODEL, D_MODEL), ("tensor", "fsdp"), "float32"),
    ("mlp/in", (D_MODEL, 4 * D_MODEL), ("fsdp", "tensor"), "float32"),
    ("mlp/in_bias", (4 * D_MODEL,), ("tensor",), "float32"),
    ("mlp/out", (4 * D_MODEL, D_MODEL), ("tensor", "fsdp"), "float32"),
    ("norm1/scale", (D_MODEL,), (), "float32"),
    ("norm2/scale", (D_MODEL,), (), "float32"),
    ("rel_pos", (32, 64), (), "float32"),
]


def mesh_shape(devices: int, per_process: int) -> dict[str, int]:
  tensor = per_process
  fsdp = min(256, devices // tensor)
  return {"data": devices // (tensor * fsdp), "fsdp": fsdp, "tensor": tensor}


def state_leaves(n: int):
  """n leaves: params, then Adam's mu and nu, layer by layer."""
  out = []
  layer = 0
  while len(out) < n:
    for prefix in ("params", "opt/mu", "opt/nu"):
      for name, shape, spec, dtype in LAYER:
        out.append(((*prefix.split("/"), f"layer_{layer}", *name.split("/")),
                    shape, spec, dtype))
    layer += 1
  return out[:n]


def one(devices: int, leaves: int, per_process: int) -> dict:
  """In this process: plan process P/2+1's share; returns the figures."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from ckpt.format import index as index_lib  # pylint: disable=g-import-not-at-top
  from ckpt.shards import placement  # pylint: disable=g-import-not-at-top
  from ckpt.shards import plan  # pylint: disable=g-import-not-at-top
  from ckpt.format import tree  # pylint: disable=g-import-not-at-top
  from ckpt.format import tsspec  # pylint: disable=g-import-not-at-top

  sizes = mesh_shape(devices, per_process)
  names = tuple(sizes)
  ids = np.arange(devices).reshape(tuple(sizes.values()))
  processes = devices // per_process
  me = processes // 2 + 1
  state = state_leaves(leaves)
  codec = tsspec.Codec().to_json()
  with measure.measure(interval_s=0) as planning:
    info = placement.make_mesh_info(names, ids, ids // per_process, me)
    layouts = []
    for parts, shape, spec, dtype in state:
      where = info.named(placement.spec_axes(spec, len(shape)), shape)
      itemsize = np.dtype(dtype).itemsize
      layouts.append(plan.leaf_layout(shape, itemsize, where,
                                      plan.DEFAULT_CHUNK_BYTES))
    writes = plan.assign_writes(layouts, me, 1 << 30)
  with measure.measure(interval_s=0) as indexing:
    entries, texts = [], {}  # save.describe_sharding caches per sharding too
    for (parts, shape, spec, dtype), lay in zip(state, layouts):
      text = texts.get(spec)
      if text is None:
        text = texts[spec] = f"NamedSharding(mesh={sizes}, spec={spec})"
      entries.append(entries_lib.ArrayEntry(
          path=parts, relpath=tree.storage_relpath(parts), shape=lay.shape,
          dtype=dtype, chunks=lay.chunks, codec=codec, source_dtype=dtype,
          sharding=text))
  plan_cpu = planning.cpu_s
  cpu = planning.cpu_s + indexing.cpu_s
  wall = planning.wall_s + indexing.wall_s
  rss = max(planning.peak_rss, indexing.peak_rss) - planning.rss_before
  structure = {}
  for parts, *_ in state:
    node = structure
    for p in parts[:-1]:
      node = node.setdefault(p, {})
    node[parts[-1]] = 0
  # The index's leaves are in tree.flatten's order (the structure's numbers)
  order = {p: i for i, (p, _) in enumerate(tree.flatten(structure))}
  entries.sort(key=lambda e: order[e.path])
  index = index_lib.Index(step=1, time=0.0, storage_format="zarr",
                          process_count=processes,
                          structure=tree.encode_structure(structure),
                          leaves=tuple(entries))
  nbytes = len(index_lib.encode(index))
  return {"devices": devices, "processes": processes, "leaves": leaves,
          "plan_cpu_s": round(plan_cpu, 3),
          "with_entries_cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
          "peak_rss_growth_mib": round(rss / 2**20, 1),
          "writes_this_host": len(writes),
          "bytes_this_host_gib": round(sum(w.nbytes for w in writes) / 2**30, 2),
          "index_bytes": nbytes,
          "index_bytes_per_leaf": round(nbytes / leaves, 1)}


def run(conf: dict) -> list[dict]:
  rows = []
  for devices in conf.get("devices", [1024, 4096, 16384]):
    for leaves in conf.get("leaves", [1000, 10000, 100000]):
      out = subprocess.run(
          [sys.executable, "-m", "scripts.scale_plan", "--one", str(devices),
           str(leaves), str(conf.get("devices_per_process", 4))],
          capture_output=True, text=True, check=True,
          timeout=conf.get("timeout_s", 600), cwd=REPO)
      rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
  return rows


COLUMNS = ["devices", "processes", "leaves", "plan_cpu_s",
           "with_entries_cpu_s", "wall_s",
           "peak_rss_growth_mib", "writes_this_host", "bytes_this_host_gib",
           "index_bytes", "index_bytes_per_leaf"]


def table(rows: list[dict]) -> str:
  lines = ["| " + " | ".join(COLUMNS) + " |",
           "|" + "---|" * len(COLUMNS)]
  lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default=os.path.join(REPO, "configs", "scale.json"))
  ap.add_argument("--one", nargs=3, type=int, metavar=("DEVICES", "LEAVES", "PER"))
  args = ap.parse_args(argv)
  if args.one:
    print(json.dumps(one(*args.one)))
    return
  conf = {}
  if os.path.exists(args.config):
    with open(args.config) as f:
      conf = json.load(f).get("plan", {})
  print(table(run(conf)))


if __name__ == "__main__":
  main()
