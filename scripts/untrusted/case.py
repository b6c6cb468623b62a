"""One hostile case in a fresh process: prints seconds, peak RSS growth, outcome."""
import os, sys, time, resource
os.environ["JAX_PLATFORMS"] = "cpu"
case, path = sys.argv[1], sys.argv[2]
import numpy as np, msgpack
import ckpt; print("using", ckpt.__file__)  # which checkout PYTHONPATH picked
from ckpt.format import index as index_lib
from ckpt.restore import read as restore_lib
from ckpt.store import storage as storage_lib
from ckpt.restore import lazy
from ckpt.restore import tasks
from ckpt.shards.plan import Box
def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
data = open(path, "rb").read() if case == "dups" else None
base = rss(); t0 = time.perf_counter()
try:
  if case == "dups":
    index_lib.decode(data); out = "decoded"
  elif case == "bomb":
    st = storage_lib.Storage(path)
    idx = restore_lib.read_index(st, "checkpoint_1")
    leaves = restore_lib.checkpoint_leaves(idx, st.step_spec("checkpoint_1"), st.context(), 1 << 30)
    leaf = next(v for v in leaves.values() if isinstance(v, lazy.LazyArray))
    x = tasks.run_sync(leaf.read_box(Box((0, 0), (1, leaf.shape[1]))))
    out = f"read a {x.shape} box"
  else:
    ckpt.load(path); out = "loaded"
except BaseException as e:
  out = f"{type(e).__name__}: {str(e)[:150]}"
print(f"{case}: {time.perf_counter() - t0:.3f} s, peak RSS +{rss() - base:.0f} MiB; {out}")
