"""Writes the golden checkpoints of today's index format version.

  python -m tests.golden.make_golden            # tests/golden/v<VERSION>/
  python -m tests.golden.make_golden --out DIR  # elsewhere (DIR/v<VERSION>/)

Each golden is a checkpoint root with two steps, each with metrics and
host_state: step 10 holds a tree of every kind of leaf (float32 and
bfloat16 jax.Arrays sharded over a 2x4 mesh of the 8 CPU devices, small
replicated ones stored inline, typed PRNG keys of two implementations, a
sharded array of keys, host numpy leaves, numpy and python scalars, a
string, bytes, nested dicts, lists and tuples, None and empty containers),
step 5 a small part of it. Seeded random data, a few KiB per golden, saved
by today's code in one of:

  zarr/    format "zarr" (v2), raw chunks, POSIX layout
  zarr3/   format "zarr3" with crc32c chunk checksums, POSIX layout
  ocdbt/   format "ocdbt" with zstd compression, POSIX layout
  bucket/  format "zarr" saved to a memory:// root: the object-store
           layout (checkpoint_<step>/attempt-<token>/..., the commit marker,
           commits/<step>, commits/complete), every key of the store dumped
           as a file (relative key = relative path)
  bucket_reuse/  the same with reuse_unchanged=True: step 10's params/wide
           is held by step 5 (held_by, from version 6)

Next to the checkpoint, ``expected.json`` (JSON, never pickle) holds what a
restore must give back, bit for bit: the tree, each array's dtype, shape,
raw bytes (base64, little-endian) and their sha256, the PRNG
implementations, the shardings the arrays were saved with, the metrics,
host_state and steps, and which index format VERSION (ckpt/format/index.py) wrote
it. tests/format/test_golden.py restores every golden of every version with
today's code and compares against it.

Goldens of a version are written once and then kept unchanged: bump
ckpt.format.index.VERSION whenever the on-disk contract changes, then run this
script, which writes the new version's folder beside the old ones (it
refuses to replace an existing folder unless given --overwrite).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before jax is imported: 8 CPU devices
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import base64  # noqa: E402
import hashlib  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import ckpt  # noqa: E402
from ckpt.format import index as index_lib  # noqa: E402
from ckpt.store import storage as storage_lib  # noqa: E402

GOLDEN_DIR = pathlib.Path(__file__).resolve().parent
EXPECTED = "expected.json"
STEPS = (5, 10)
# The save time written into every index (the Checkpointer's clock).
SAVE_TIME = 1_735_689_600.0  # 2025-01-01T00:00:00Z
# Small chunks: a few KiB per golden, several chunk files per array.
CHUNK_BYTES = 256
# Name -> (Checkpointer options, layout). The options are recorded in
# expected.json for information only: a reader never needs them.
GOLDENS = {
    "zarr": (dict(format="zarr"), "posix"),
    "zarr3": (dict(format="zarr3", chunk_checksums=True), "posix"),
    "ocdbt": (dict(format="ocdbt", compression="zstd"), "posix"),
    "bucket": (dict(format="zarr"), "bucket"),
    # Index version 6: params/wide of step 10 is held by step 5.
    "bucket_reuse": (dict(format="zarr", reuse_unchanged=True), "bucket"),
}
MESH_SHAPE, MESH_AXES = (2, 4), ("x", "y")


def version_dir(root: pathlib.Path = GOLDEN_DIR,
                version: int = index_lib.VERSION) -> pathlib.Path:
  """Where the goldens of index format ``version`` live."""
  return root / f"v{version}"


def make_state(step: int) -> dict[str, Any]:
  """The state saved as ``step``: seeded random data (never constant), a
  few KiB, every kind of leaf a checkpoint holds. The older step (5) holds
  only a small part of it, to keep the goldens small."""
  rng = np.random.default_rng(1000 + step)
  devices = np.asarray(jax.devices()[:8]).reshape(MESH_SHAPE)
  mesh = Mesh(devices, MESH_AXES)

  def put(x, *spec):
    sharding = NamedSharding(mesh, P(*spec))
    return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

  def normal(shape, dtype=np.float32):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

  kernel = put(normal((16, 8)), "x", None)
  # The same at both steps (index version 6): "bucket_reuse"'s step 10
  # holds none of it, step 5 holds it for both (held_by).
  wide = put(np.random.default_rng(3000).standard_normal(
      (16, 32), dtype=np.float32), "x", "y")
  if step != STEPS[-1]:
    return {"params": {"dense": {"kernel": kernel}, "wide": wide},
            "step": step}
  # Arrays over INLINE_MAX_BYTES (256) are stored as arrays, smaller ones
  # (and fully replicated small jax.Arrays) inline in the index.
  return {
      "params": {
          "dense": {"kernel": kernel,                      # 2 chunks
                    "bias": put(normal((8,)), None)},      # inline
          "embed": put(normal((8, 16)), "y", None),        # 4 chunks
          # Index version 2: the arrays above are packed (_save packs
          # leaves of at most PACK_MAX_BYTES); this one is a zarr array.
          "wide": wide,                                    # 8 chunks
          "norm_bf16": put(normal((16, 16), ml_dtypes.bfloat16),
                           None, "x"),                     # 2 chunks
          "layers": [put(normal((4, 4)), None, None),      # inline
                     normal((2, 3), np.float16)],          # inline numpy
      },
      "opt_state": ({"count": np.int32(step), "mu": normal((3, 3))},
                    None, {}, []),
      "rng": jax.random.key(0),                            # inline keys
      "rngs": jax.device_put(jax.random.split(jax.random.key(step), 64),
                             NamedSharding(mesh, P("x"))),  # 2 chunks
      "rbg_key": jax.random.key(step, impl="rbg"),
      "data": {
          "tokens": rng.integers(-2**31, 2**31 - 1, (8, 16),
                                 dtype=np.int32),          # 2 chunks
          "lengths": rng.integers(0, 100, (5,), dtype=np.int32),
          "mask": rng.random((7,)) < 0.5,
          "float64": rng.standard_normal((2, 2)),
      },
      "step": step,
      "lr": float(rng.random()) * 1e-3,
      "scale": np.float32(rng.standard_normal()),
      "done": False,
      "name": "golden run \u00e9",
      "blob": rng.bytes(5),
  }


def make_metrics(step: int) -> dict[str, Any]:
  rng = np.random.default_rng(2000 + step)
  # Flat names (a nested {"eval": {"loss": x}} is saved as "eval/loss"), so
  # the expected value is what metrics(step) returns.
  return {"loss": float(rng.random()) * 3,
          "eval/loss": float(rng.random()) * 3,
          "tokens": int(step * 4096)}


def make_host_state(step: int) -> dict[str, Any]:
  return {"data_pos": 123 if step == STEPS[-1] else 100 + step,
          "epoch": step // 5, "files": ["shard-0001", "shard-0002"]}


# ---- the JSON description of a tree (what expected.json holds) -------------

def _b64(data: bytes) -> str:
  return base64.b64encode(data).decode("ascii")


def _array(x: np.ndarray) -> dict[str, Any]:
  data = x.astype(x.dtype.newbyteorder("<")).tobytes(order="C")
  return {"dtype": x.dtype.name, "shape": list(x.shape), "data": _b64(data),
          "sha256": hashlib.sha256(data).hexdigest()}


def _sharding(x: Any) -> dict[str, Any] | None:
  """A jax.Array's NamedSharding as JSON (mesh shape, axes, spec)."""
  s = getattr(x, "sharding", None)
  if not isinstance(s, NamedSharding):
    return None
  spec = [list(p) if isinstance(p, tuple) else p for p in s.spec]
  return {"mesh_shape": list(s.mesh.devices.shape),
          "mesh_axes": list(s.mesh.axis_names), "spec": spec}


def describe(node: Any) -> Any:
  """``node`` (a state) as JSON: containers as {"dict": {key: child}},
  {"list": [...]}, {"tuple": [...]}, {"none": null}; leaves as
  {"leaf": {...}} with their exact bytes."""
  if node is None:
    return {"none": None}
  if isinstance(node, dict):
    if not all(isinstance(k, str) for k in node):
      raise TypeError(f"golden dict keys must be str, got {list(node)}")
    return {"dict": {k: describe(v) for k, v in node.items()}}
  if isinstance(node, list):
    return {"list": [describe(v) for v in node]}
  if type(node) is tuple:
    return {"tuple": [describe(v) for v in node]}
  return {"leaf": _describe_leaf(node)}


def _describe_leaf(x: Any) -> dict[str, Any]:
  if isinstance(x, jax.Array):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      impl = jax.random.key_impl(x)
      impl = impl if isinstance(impl, str) else str(getattr(impl, "name", impl))
      return {"kind": "keys", "impl": impl, "shape": list(x.shape),
              "key_data": _array(np.asarray(jax.random.key_data(x))),
              "sharding": _sharding(x)}
    return {"kind": "array", "saved_as": "jax", **_array(np.asarray(x)),
            "sharding": _sharding(x)}
  if isinstance(x, np.ndarray):
    return {"kind": "array", "saved_as": "numpy", **_array(x),
            "sharding": None}
  if isinstance(x, np.generic):
    return {"kind": "numpy_scalar", **_array(np.asarray(x))}
  if isinstance(x, bool):
    return {"kind": "python", "type": "bool", "value": x}
  if isinstance(x, int):
    return {"kind": "python", "type": "int", "value": x}
  if isinstance(x, float):
    return {"kind": "python", "type": "float", "value": x.hex()}
  if isinstance(x, str):
    return {"kind": "python", "type": "str", "value": x}
  if isinstance(x, bytes):
    return {"kind": "python", "type": "bytes", "value": _b64(x)}
  raise TypeError(f"no golden description for {type(x)}")


def expected(name: str) -> dict[str, Any]:
  """The expected.json document of golden ``name`` (no I/O)."""
  options, layout = GOLDENS[name]
  return {
      "comment": "written by tests/golden/make_golden.py; see its docstring",
      "index_version": index_lib.VERSION,
      "ckpt_version": ckpt.__version__,
      "jax_version": jax.__version__,
      "tensorstore_version": importlib.metadata.version("tensorstore"),
      "name": name, "layout": layout,
      "options": {**options, "chunk_bytes": CHUNK_BYTES},
      "steps": {str(s): {"state": describe(make_state(s)),
                         "metrics": make_metrics(s),
                         "host_state": make_host_state(s)} for s in STEPS},
  }


def to_json(v: Any, indent: int = 0) -> str:
  """JSON text of ``v``, readable and small: a leaf's description (a map
  with "kind") or anything short on one line, the rest indented by one."""
  flat = json.dumps(v, ensure_ascii=True)
  if (not isinstance(v, (dict, list)) or len(flat) <= 78 - indent or
      isinstance(v, dict) and "kind" in v):
    return flat
  pad, end = " " * (indent + 1), "\n" + " " * indent
  if isinstance(v, dict):
    items = [f"{pad}{json.dumps(k)}: {to_json(x, indent + 1)}"
             for k, x in v.items()]
    return "{\n" + ",\n".join(items) + end + "}"
  items = [pad + to_json(x, indent + 1) for x in v]
  return "[\n" + ",\n".join(items) + end + "]"


# ---- writing ---------------------------------------------------------------

# Leaves of at most this many bytes are packed (ckpt/save/pack.py) in the
# goldens: every array leaf but params/wide (the goldens hold both kinds).
PACK_MAX_BYTES = 512


def _save(url: str, options: dict[str, Any]) -> None:
  from ckpt.save import pack  # pylint: disable=g-import-not-at-top
  kept, pack.MAX_LEAF_BYTES = pack.MAX_LEAF_BYTES, PACK_MAX_BYTES
  try:
    _save_steps(url, options)
  finally:
    pack.MAX_LEAF_BYTES = kept


def _save_steps(url: str, options: dict[str, Any]) -> None:
  with ckpt.Checkpointer(url, async_save=False, chunk_bytes=CHUNK_BYTES,
                         clock=lambda: SAVE_TIME, **options) as c:
    for s in STEPS:
      if s == STEPS[-1] and options.get("reuse_unchanged"):
        # reuse keeps two copies: the step after the first writes the
        # second one; the next holds the first (and this one goes).
        c.save(s - 1, make_state(s))
        c.delete(s - 1)
      c.save(s, make_state(s), metrics=make_metrics(s),
             host_state=make_host_state(s))


def dump_memory(url: str, out: pathlib.Path) -> list[str]:
  """Every key of the memory:// root ``url`` written as a file under
  ``out`` (relative key = relative path); the keys, sorted."""
  storage = storage_lib.Storage(url)
  keys = sorted(k.decode() for k in storage.kv.list().result())
  for key in keys:
    if key.startswith("/") or ".." in key.split("/"):
      raise ValueError(f"unexpected key {key!r} in {url}")
    path = out / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(storage.read_bytes(key))
  return keys


def write_golden(name: str, out: pathlib.Path) -> None:
  """Saves golden ``name`` into the (new) directory ``out``."""
  options, layout = GOLDENS[name]
  out.mkdir(parents=True)
  if layout == "posix":
    _save(os.fspath(out), options)
  else:
    url = f"memory://golden-{name}-{os.getpid()}-{os.urandom(4).hex()}"
    _save(url, options)
    dump_memory(url, out)
  (out / EXPECTED).write_text(to_json(expected(name)) + "\n")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=GOLDEN_DIR,
                      help="the folder of v<VERSION>/ (default: %(default)s)")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace an existing v<VERSION>/ folder")
  args = parser.parse_args(argv)
  if jax.device_count() < 8:
    parser.error(f"needs 8 devices, found {jax.devices()} (XLA_FLAGS is set "
                 "only when run as python -m tests.golden.make_golden)")
  final = version_dir(args.out)
  if final.exists() and not args.overwrite:
    parser.error(f"{final} exists: goldens of a released version are never "
                 "rewritten. Bump ckpt.format.index.VERSION if the on-disk contract "
                 "changed, or pass --overwrite")
  args.out.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=args.out, prefix=".tmp-golden-") as tmp:
    staged = pathlib.Path(tmp) / final.name
    for name in GOLDENS:
      write_golden(name, staged / name)
    if final.exists():
      shutil.rmtree(final)
    staged.rename(final)
  print(f"wrote {', '.join(GOLDENS)} into {final}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
