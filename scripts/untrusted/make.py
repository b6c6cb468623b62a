"""Builds the hostile checkpoints (with the new code) under /tmp/m17/cases."""
import json, os, shutil, struct, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import numpy as np, msgpack, tensorstore as ts
import ckpt
from ckpt.format import tsspec
C = "/tmp/m17/cases"; shutil.rmtree(C, ignore_errors=True)
def save(name, fmt="zarr", state=None):
  root = f"{C}/{name}"
  with ckpt.Checkpointer(root, async_save=False, format=fmt, chunk_bytes=16 << 20) as c:
    c.save(1, state or {"w": np.ones((64, 256), np.float32)})
  return root, f"{root}/checkpoint_1"
# 1. nil array, 256 MiB (the old limit was 1 GiB)
root, step = save("nils")
n = 256 << 20
with open(f"{step}/index.msgpack", "wb") as f:
  f.write(b"\xdd" + struct.pack(">I", n)); f.write(b"\xc0" * n)
# 2. duplicate paths: 100,000 entries, 50,000 paths twice
n = 100_000
entries = [{"path": [f"p{i % (n // 2)}"], "kind": "value", "value": {"py": "int", "v": 1}} for i in range(n)]
doc = {"format": "ckpt", "version": 1, "step": 1, "time": 0.0, "storage_format": "zarr", "process_count": 1, "metrics": {}, "structure": {"node": "none"}, "leaves": entries, "host_state": None}
os.makedirs(C, exist_ok=True)
open(f"{C}/dups.msgpack", "wb").write(msgpack.packb(doc, use_bin_type=True))
# 3. huge shape: index and .zarray agree on (2**40, 2**21) float32 (8 PiB)
root, step = save("huge")
path = f"{step}/index.msgpack"
d = msgpack.unpackb(open(path, "rb").read(), raw=False)
from ckpt.format import index_codec
from ckpt.format import entries as entries_lib
rows = index_codec.rows(d["leaves"]); e = rows[0]; e.update(shape=[2**40, 2**21], chunks=[1, 2**21], checksums=[])
d["leaves"] = index_codec.columns(rows, entries_lib.KINDS)
open(path, "wb").write(msgpack.packb(d, use_bin_type=True))
meta = json.load(open(f"{step}/w/.zarray")); meta.update(shape=[2**40, 2**21], chunks=[1, 2**21])
json.dump(meta, open(f"{step}/w/.zarray", "w"))
# 4. chunk bomb: w (16384, 16384) float32 saved in 16 MiB chunks, then replaced
# by ONE zstd chunk of ones (1 GiB decoded)
shape = (16384, 16384)
root, step = save("bomb", state={"w": np.zeros(shape, np.float32)})
shutil.rmtree(f"{step}/w")
spec = tsspec.array_spec("zarr", {"driver": "file", "path": step + "/"}, "w", shape, np.float32, shape, tsspec.Codec("zstd", 3))
s = ts.open(spec, create=True).result()
s.write(np.ones(shape, np.float32)).result()
print("bomb chunk on disk:", os.path.getsize(f"{step}/w/0.0"), "bytes")
