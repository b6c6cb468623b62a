"""Benchmark: Hugging Face safetensors in (ckpt.load_safetensors) and out
(ckpt.export_safetensors) against the plain way.

Usage (from the repository root):
  python -m scripts.bench_safetensors [--hidden 1024] [--layers 32]
      [--vocab 32000] [--shards 4] [--layouts 1x8,2x4,4x2]
      [--budget 268435456] [--stores disk,s3] [--out F]

A synthetic Llama-shaped model (random bf16; ``--layers`` layers, hidden
``--hidden``, grouped-query attention with 4 query heads per key-value
head, MLP 2.75x hidden, ``--vocab`` tokens; about 0.85 GB at the
defaults) is written as ``--shards`` files and their index JSON with the
``safetensors`` library. For each layout P x D (P real processes of D CPU
devices; a mesh ("fsdp", "tp") of shape (P, D), one process: (2, 4)) every
process loads it onto a transformer sharding (the layers scanned: names
with [i] and .T; ``--fsdp-on out``: kernels (in, out) over (tp, fsdp), so
fsdp splits the files' rows; ``in``: over (fsdp, tp), the files' columns;
the embedding and head alike, the norms replicated), then the plain way: ``safetensors.numpy.load_file`` of every file,
the same stacking and transposing in numpy, and each device's shard put
on it (``jax.make_array_from_callback``: a ``device_put`` without its
cross-process check) onto the same shardings (the limit). Per process: wall seconds, the bytes its boxes
asked and the whole rows it fetched (``readcount.ReadCounter``, as a
restore counts), what TensorStore's kvstore drivers read (S3 only: the
file driver maps files and counts nothing), the byte limiter's peak, and
the peak RSS above the RSS before (``benchlib.measure``) less the result's
own bytes on this process's devices (CPU devices keep it in host memory):
what the load held besides its result, against ``--budget``.

Then (layout 1 x 8 only) the loaded params are saved as a ckpt step and
exported back (``export_safetensors``, 1 GiB shards) against the plain way
(``ckpt.load`` of the step, unstacking in numpy, ``save_file`` of each
shard): wall seconds, bytes written and peak extra RSS.

``--stores s3`` runs the loads from moto's S3 (started here; the files
uploaded first) too.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from scripts.benchlib import presets
from scripts.benchlib import report

COLUMNS = [
    ("store", "store", "{}"), ("layout", "layout", "{}"),
    ("fsdp splits", "fsdp_on", "{}"),
    ("system", "system", "{}"), ("wall s (slowest)", "wall_s", "{:.2f}"),
    ("MiB asked / process", "asked_text", "{}"),
    ("MiB fetched / process", "fetched_text", "{}"),
    ("MiB extra RSS less result / process", "extra_text", "{}"),
    ("MiB limiter peak", "peak_text", "{}"),
]
LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def shapes(hidden: int, layers: int, vocab: int) -> dict[str, tuple]:
  heads = hidden // 64
  kv, mlp = heads // 4 * 64, hidden * 11 // 4
  out = {"model.embed_tokens.weight": (vocab, hidden),
         "model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
  for i in range(layers):
    p = f"model.layers.{i}."
    out.update({p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "mlp.gate_proj.weight": (mlp, hidden),
                p + "mlp.up_proj.weight": (mlp, hidden),
                p + "mlp.down_proj.weight": (hidden, mlp),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,)})
  return out


NAMES = [
    (r"model\.embed_tokens\.weight", "embed"),
    (r"model\.norm\.weight", "norm"),
    (r"lm_head\.weight", "lm_head.T"),
    (r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\.weight",
     r"layers/\2/\3[\1].T"),
    (r"model\.layers\.(\d+)\.(input|post_attention)_layernorm\.weight",
     r"layers/\2_norm[\1]"),
]


def write_model(directory: str, conf: dict) -> int:
  """The model as ``conf["shards"]`` files + index; its bytes."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  table = shapes(conf["hidden"], conf["layers"], conf["vocab"])
  keys = list(table)
  n = conf["shards"]
  total = sum(int(np.prod(s)) * 2 for s in table.values())
  weight_map, cut, done = {}, [[] for _ in range(n)], 0
  for k in keys:  # consecutive keys, about total / n bytes a file
    cut[min(n - 1, done * n // total)].append(k)
    done += int(np.prod(table[k])) * 2
  for i, part in enumerate(cut):
    name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    # Random finite bf16: random bits with the exponent's top bit cleared.
    data = {k: (rng.integers(0, 1 << 16, table[k], dtype=np.uint16) & 0xBFFF
                ).view(ml_dtypes.bfloat16) for k in part}
    save_file(data, os.path.join(directory, name), metadata={"format": "pt"})
    weight_map.update({k: name for k in part})
    del data
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
  return total


# ---- the worker (one process of a layout) -------------------------------------

def _target(conf: dict, mesh):
  """(target tree of ShapeDtypeStructs, {path: how to make it in numpy})."""
  import jax  # pylint: disable=g-import-not-at-top
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  table = shapes(conf["hidden"], conf["layers"], conf["vocab"])
  bf16 = ml_dtypes.bfloat16

  def leaf(shape, *spec):
    return jax.ShapeDtypeStruct(shape, bf16,
                                sharding=NamedSharding(mesh, P(*spec)))
  h, n = conf["hidden"], conf["layers"]
  # "out": fsdp (across processes) splits every weight's out axis, the rows
  # of the files' tensors; "in": its in axis (their columns); "none": no
  # weight is split over fsdp (each held whole by every process: read once
  # on a bucket).
  kernel = {"out": ("tp", "fsdp"), "in": ("fsdp", "tp"),
            "none": (None, "tp")}[conf["fsdp_on"]]
  tgt = {"embed": leaf((conf["vocab"], h), *reversed(kernel)),
         "norm": leaf((h,)), "lm_head": leaf((h, conf["vocab"]), *kernel),
         "layers": {}}
  recipe = {"embed": ("model.embed_tokens.weight", None, False),
            "norm": ("model.norm.weight", None, False),
            "lm_head": ("lm_head.weight", None, True)}
  for w in LAYER:
    group, name = w.split(".")
    name = name.removesuffix("_proj")
    out, inn = table[f"model.layers.0.{w}.weight"]
    tgt["layers"].setdefault(group, {})[name] = leaf((n, inn, out), None,
                                                     *kernel)
    recipe[f"layers/{group}/{name}"] = (f"model.layers.{{}}.{w}.weight", n, True)
  for norm in ("input", "post_attention"):
    tgt["layers"][f"{norm}_norm"] = leaf((n, h))
    recipe[f"layers/{norm}_norm"] = (
        f"model.layers.{{}}.{norm}_layernorm.weight", n, False)
  return tgt, recipe


def _flat(tree) -> dict[str, Any]:
  import jax  # pylint: disable=g-import-not-at-top
  return {"/".join(k.key for k in p): v
          for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _result_bytes(tree) -> int:
  return sum(s.data.nbytes for a in _flat(tree).values()
             for s in a.addressable_shards)


def worker(conf: dict) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.restore import readcount  # pylint: disable=g-import-not-at-top
  from ckpt.store import storemeter  # pylint: disable=g-import-not-at-top
  from scripts.benchlib.measure import measure  # pylint: disable=g-import-not-at-top
  me = jax.process_index()
  devices = np.array(jax.devices())
  # tp: a process's devices (one process: 4); fsdp: across the processes.
  tp = jax.local_device_count() if jax.process_count() > 1 else 4
  mesh = jax.sharding.Mesh(devices.reshape(-1, tp), ("fsdp", "tp"))
  tgt, recipe = _target(conf, mesh)
  out = {"process": me}
  counter = readcount.ReadCounter()
  readcount.COUNTER.set(counter)
  meter = storemeter.Meter()
  with measure() as m, meter:
    got = ckpt.load_safetensors(conf["src"], target=tgt, names=NAMES,
                                concurrent_bytes=conf["budget"])
    jax.block_until_ready(got)
  result = _result_bytes(got)
  flat, want_flat = _flat(got), _flat(tgt)
  out["ckpt"] = {"wall_s": m.wall_s, "extra_rss": m.extra_rss - result,
                 "asked": counter.bytes_read,
                 "fetched": counter.chunk_bytes_read,
                 "store_fetched": meter.value, "peak": counter.peak_in_use,
                 "result": result}
  if conf.get("save"):
    with ckpt.Checkpointer(conf["save"], async_save=False) as c:
      c.save(1, got)
  del got
  gc.collect()
  if conf.get("plain", True) and "://" not in conf["src"]:
    with measure() as m:
      tensors = {}
      for name in sorted(os.listdir(conf["src"])):
        if name.endswith(".safetensors"):
          tensors.update(load_file(os.path.join(conf["src"], name)))
      placed = {}
      for path, (key, n, t) in recipe.items():
        if n is None:
          x = tensors[key].T if t else tensors[key]
        else:
          x = np.stack([tensors[key.format(i)].T if t else
                        tensors[key.format(i)] for i in range(n)])
        placed[path] = jax.make_array_from_callback(
            x.shape, want_flat[path].sharding, lambda i, x=x: x[i])
      jax.block_until_ready(placed)
    out["plain"] = {"wall_s": m.wall_s,
                    "extra_rss": m.extra_rss - sum(
                        s.data.nbytes for a in placed.values()
                        for s in a.addressable_shards),
                    "asked": sum(v.nbytes for v in tensors.values())}
    del tensors, placed, flat
  return out


# ---- export (one process) --------------------------------------------------------

def export_figures(step_root: str, work: str, conf: dict) -> list[dict]:
  import numpy as np  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from scripts.benchlib.measure import measure  # pylint: disable=g-import-not-at-top
  rows = []
  with measure() as m:
    rep = ckpt.export_safetensors(step_root, os.path.join(work, "export"),
                                  names=NAMES, max_shard_bytes=1 << 30)
  rows.append({"system": "ckpt export", "wall_s": m.wall_s,
               "extra_rss": m.extra_rss, "written": rep.total_size})
  _, recipe = _target({**conf, "fsdp_on": "out"}, _fake_mesh())
  with measure() as m:
    state = ckpt.load(step_root)
    tensors = {}
    for path, (key, n, t) in recipe.items():
      node = state
      for p in path.split("/"):
        node = node[p]
      if n is None:
        tensors[key] = np.ascontiguousarray(node.T if t else node)
      else:
        for i in range(n):
          tensors[key.format(i)] = np.ascontiguousarray(
              node[i].T if t else node[i])
    os.makedirs(os.path.join(work, "plain"))
    save_file(tensors, os.path.join(work, "plain", "model.safetensors"))
  rows.append({"system": "ckpt.load + save_file", "wall_s": m.wall_s,
               "extra_rss": m.extra_rss,
               "written": sum(v.nbytes for v in tensors.values())})
  return rows


def _fake_mesh():
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1),
                           ("fsdp", "tp"))


# ---- the driver ------------------------------------------------------------------

def _mib(values) -> str:
  return "/".join(f"{v / 2**20:.0f}" for v in values)


def run(args) -> tuple[list[dict], list[dict], dict]:
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  work = tempfile.mkdtemp(prefix="ckpt-bench-st-", dir=args.dir)
  conf = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
          "shards": args.shards, "budget": args.budget}
  runs = [(s, l, f) for s in args.stores.split(",")
          for l in args.layouts.split(",") for f in args.fsdp_on.split(",")]
  rows, export_rows, info = [], [], {}
  moto = None
  try:
    src = os.path.join(work, "model")
    os.makedirs(src)
    t0 = time.perf_counter()
    info["model_bytes"] = write_model(src, conf)
    info["write_s"] = time.perf_counter() - t0
    stores = {"disk": src}
    if "s3" in args.stores.split(","):
      from tests.objectstore import servers  # pylint: disable=g-import-not-at-top
      from ckpt.store import storage as storage_lib  # pylint: disable=g-import-not-at-top
      moto = servers.start_moto(work)
      os.environ.update(moto.env)
      url = servers.new_bucket(moto) + "/model"
      storage = storage_lib.Storage(url)
      for name in sorted(os.listdir(src)):
        with open(os.path.join(src, name), "rb") as f:
          storage.write_bytes(name, f.read())
      stores["s3"] = url
    for store, layout, fsdp_on in runs:
      where = stores[store]
      p, d = (int(x) for x in layout.split("x"))
      save = (os.path.join(work, "ck") if store == "disk" and p == 1
              and args.export and not export_rows else None)
      out = local_cluster.check(local_cluster.run(
          "scripts.bench_safetensors", {**conf, "src": where, "save": save,
                                        "fsdp_on": fsdp_on},
          num_processes=p, devices_per_process=d, timeout_s=1800,
          extra_env=moto.env if moto else None, cwd=str(presets.ROOT)))
      for system in ("ckpt", "plain"):
        recs = [r[system] for r in out if system in r]
        if not recs:
          continue
        rows.append({
            "store": store, "layout": layout, "fsdp_on": fsdp_on,
            "system": ("load_safetensors" if system == "ckpt" else
                       "load_file + device_put"),
            "wall_s": max(r["wall_s"] for r in recs),
            "asked": [r["asked"] for r in recs],
            "fetched": [r.get("fetched", r["asked"]) for r in recs],
            "store_fetched": [r.get("store_fetched", 0) for r in recs],
            "extra_rss": [r["extra_rss"] for r in recs],
            "peak": [r.get("peak", 0) for r in recs]})
      if save:
        export_rows = export_figures(save, work, conf)
  finally:
    if moto is not None:
      moto.stop()
    shutil.rmtree(work, ignore_errors=True)
  for r in rows:
    r["asked_text"] = _mib(r["asked"])
    fetched = r["store_fetched"] if r["store"] == "s3" else r["fetched"]
    r["fetched_text"] = _mib(fetched)
    r["extra_text"] = _mib(r["extra_rss"])
    r["peak_text"] = _mib(r["peak"]) if any(r["peak"]) else "-"
  return rows, export_rows, info


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=__doc__.split("\n\n", 1)[1])
  parser.add_argument("--hidden", type=int, default=1024)
  parser.add_argument("--layers", type=int, default=32)
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--shards", type=int, default=4)
  parser.add_argument("--layouts", default="1x8,2x4,4x2",
                      help="comma-separated PROCESSESxDEVICES")
  parser.add_argument("--budget", type=int, default=256 << 20,
                      help="concurrent_bytes of the loads")
  parser.add_argument("--stores", default="disk", help="disk[,s3]")
  parser.add_argument("--fsdp-on", default="out",
                      help="comma-separated: out (fsdp, across processes, "
                      "splits the weights' out axis: the files' rows), in "
                      "(their in axis: the files' columns), none (the "
                      "weights replicated over the processes)")
  parser.add_argument("--no-export", dest="export", action="store_false")
  parser.add_argument("--dir", default=None, help="where to write (tmp)")
  parser.add_argument("--out", default=None, help="the JSON report")
  args = parser.parse_args(argv)
  rows, export_rows, info = run(args)
  print(f"model: {info['model_bytes'] / 2**20:.0f} MiB in {args.shards} "
        f"files (written in {info['write_s']:.1f} s); budget "
        f"{args.budget / 2**20:.0f} MiB")
  table = report.markdown(COLUMNS, rows)
  print(table)
  export_table = ""
  if export_rows:
    export_table = report.markdown(
        [("export", "system", "{}"), ("wall s", "wall_s", "{:.2f}"),
         ("MiB written", "written_mib", "{:.0f}"),
         ("MiB extra RSS", "extra_mib", "{:.0f}")],
        [{**r, "written_mib": r["written"] / 2**20,
          "extra_mib": r["extra_rss"] / 2**20} for r in export_rows])
    print(export_table)
  if args.out:
    report.write(args.out, {"rows": rows, "export": export_rows, **info,
                            "table": table, "export_table": export_table,
                            "command": report.command(
                                "scripts.bench_safetensors", argv)})
  return 0


if __name__ == "__main__":
  if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
    from ckpt.multihost import local_cluster as _lc  # pylint: disable=g-import-not-at-top
    _config = json.loads(sys.argv[1])
    _lc.init_from_env()
    _lc.write_result(worker(_config))
  else:
    sys.exit(main())
