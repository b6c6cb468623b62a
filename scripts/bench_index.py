"""What encoding and decoding ``index.msgpack`` costs at N leaves.

Builds an Index of N leaves shaped like a large training job's: a
transformer state (params and two Adam moments per layer) with long
nested paths (``params/decoder/layers/17/attn/q_proj/kernel``), array
leaves saved in a NamedSharding over a (data, fsdp, tensor) mesh (so each
entry has its saved sharding and sharding text) with the crc32c checksum
codec of format zarr3, small leaves kept inline (python ints and floats,
numpy scalars and tiny arrays), and a PRNG key per layer (threefry key
data). Encodes it with ``index.encode`` (what process 0 runs before the
commit) and decodes the bytes with ``index.decode`` (what every reader
runs), each the best of ``--repeat`` runs in CPU seconds of this process
(other work on the machine does not inflate CPU time as it does wall
time), and reports the encoded size.

Usage (from the repository root):
  python -m scripts.bench_index --leaves 100000 [--repeat 3]
  python -m scripts.bench_index --leaves 100000 --profile decode
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats

import numpy as np

from ckpt.format import index as index_lib
from ckpt.format import tree
from ckpt.format import checks
from ckpt.format import entries as entries_lib
from ckpt.format import saved_sharding
from scripts.benchlib import measure

MESH = {"mesh_axes": ["data", "fsdp", "tensor"], "mesh_shape": [4, 64, 4]}
# (path under the layer, shape, spec or None for an inline value): one layer.
LAYER = [
    ("attn/q_proj/kernel", (8192, 8192), ["fsdp", "tensor"]),
    ("attn/k_proj/kernel", (8192, 1024), ["fsdp", "tensor"]),
    ("attn/v_proj/kernel", (8192, 1024), ["fsdp", "tensor"]),
    ("attn/o_proj/kernel", (8192, 8192), ["tensor", "fsdp"]),
    ("mlp/gate_proj/kernel", (8192, 28672), ["fsdp", "tensor"]),
    ("mlp/up_proj/kernel", (8192, 28672), ["fsdp", "tensor"]),
    ("mlp/down_proj/kernel", (28672, 8192), ["tensor", "fsdp"]),
    ("mlp/down_proj/bias", (8192,), ["tensor"]),
    ("input_layernorm/scale", (8192,), []),
    ("post_attention_layernorm/scale", (8192,), [["data", "fsdp"]]),
    ("attn/rotary/inv_freq", (64,), None),       # inline numpy array
    ("attn/logit_scale", (), None),              # inline numpy scalar
]
CODEC = {"compression": None, "level": 1, "checksum": "crc32c"}


def _chunks(shape: tuple[int, ...]) -> tuple[int, ...]:
  """About 64 MiB float32 chunks, as plan.leaf_layout picks them."""
  chunks, budget = list(shape), (64 << 20) // 4
  for i in range(len(chunks)):
    while np.prod(chunks) > budget and chunks[i] > 1:
      chunks[i] = -(-chunks[i] // 2)
  return tuple(chunks)


def build(n: int) -> index_lib.Index:
  """An Index of ``n`` leaves (see the module docstring)."""
  entries, nested = [], {}
  layer = 0
  while len(entries) < n:
    for prefix in ("params/decoder/layers", "opt_state/0/mu/decoder/layers",
                   "opt_state/0/nu/decoder/layers"):
      for name, shape, spec in LAYER:
        parts = (*prefix.split("/"), str(layer), *name.split("/"))
        if spec is None:
          value = (np.float32(0.125) if shape == () else
                   np.arange(shape[0], dtype=np.float32))
          entries.append(entries_lib.ValueEntry(parts, value))
        else:
          saved = checks.decode_saved_sharding(
              {**MESH, "spec": spec}, "", len(shape))
          entries.append(entries_lib.ArrayEntry(
              parts, tree.storage_relpath(parts), shape, "float32",
              _chunks(shape), CODEC, "bfloat16", str(saved),
              saved_sharding=saved))
    parts = ("rng", "layers", str(layer), "dropout_key")
    entries.append(entries_lib.ArrayEntry(
        parts, tree.storage_relpath(parts), (8, 2), "uint32", (8, 2),
        CODEC, "uint32", saved_sharding.HOST_REPLICATED, prng_impl="threefry2x32"))
    parts = ("counters", str(layer))
    entries.append(entries_lib.ValueEntry(parts, layer * 1000 + 7))
    parts = ("schedule", str(layer))
    entries.append(entries_lib.ValueEntry(parts, 0.5 / (layer + 1)))
    layer += 1
  entries = entries[:n]
  for e in entries:
    node = nested
    for p in e.path[:-1]:
      node = node.setdefault(p, {})
    node[e.path[-1]] = 0
  nested = _lists(nested)
  # The index's leaves are in tree.flatten's order (the structure's numbers)
  order = {p: i for i, (p, _) in enumerate(tree.flatten(nested))}
  entries.sort(key=lambda e: order[e.path])
  return index_lib.Index(step=1000, time=1.7e9, storage_format="zarr3",
                         process_count=256,
                         structure=tree.encode_structure(nested),
                         leaves=tuple(entries), metrics={"loss": 1.5})


def _lists(node):
  """Dicts keyed 0, 1, ... become lists (layers, optimizer state)."""
  if not isinstance(node, dict):
    return node
  out = {k: _lists(v) for k, v in node.items()}
  if list(out) == [str(i) for i in range(len(out))]:
    return list(out.values())
  return out


def same(a: entries_lib.Entry, b: entries_lib.Entry) -> bool:
  """Entries equal, inline numpy values compared by dtype and bytes."""
  if type(a) is not type(b):
    return False
  if isinstance(a, entries_lib.ValueEntry):
    va, vb = a.value, b.value
    if isinstance(va, (np.ndarray, np.generic)):
      return (type(va) is type(vb) and va.dtype == vb.dtype and
              np.shape(va) == np.shape(vb) and va.tobytes() == vb.tobytes()
              and (a.path, a.prng_impl, a.saved_sharding) ==
              (b.path, b.prng_impl, b.saved_sharding))
  return a == b


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--leaves", type=int, default=100_000)
  ap.add_argument("--repeat", type=int, default=3)
  ap.add_argument("--profile", choices=["encode", "decode"],
                  help="print a cProfile of one run of this instead")
  args = ap.parse_args(argv)
  index = build(args.leaves)
  # The figures are about the codec's speed, not the size limit: an index
  # of long paths at 100,000 leaves may be over MAX_INDEX_BYTES.
  index_lib.MAX_INDEX_BYTES = 1 << 30
  data = index_lib.encode(index)
  if args.profile:
    fn = ((lambda: index_lib.encode(index)) if args.profile == "encode" else
          (lambda: index_lib.decode(data)))
    prof = cProfile.Profile()
    prof.runcall(fn)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    return
  encode_s, _ = measure.best_cpu(lambda: index_lib.encode(index), args.repeat)
  decode_s, back = measure.best_cpu(lambda: index_lib.decode(data), args.repeat)
  if (len(back.leaves) != len(index.leaves) or back.structure !=
      index.structure or not all(map(same, back.leaves, index.leaves))):
    raise SystemExit("decode(encode(index)) differs from the index")
  print(json.dumps({
      "leaves": args.leaves, "version": index_lib.VERSION,
      "encode_cpu_s": round(encode_s, 3), "decode_cpu_s": round(decode_s, 3),
      "bytes": len(data), "bytes_per_leaf": round(len(data) / args.leaves, 1),
  }))


if __name__ == "__main__":
  main()
