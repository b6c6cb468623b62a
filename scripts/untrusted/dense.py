"""Decode of a 32 MiB (the cap) hostile index of one item repeated; fresh process."""
import sys, time, resource, struct
from ckpt.format import index as index_lib
item = bytes.fromhex(sys.argv[1])
cap = index_lib.MAX_INDEX_BYTES - 64
per = (1 << 20) - 1
n = cap // len(item)
outer = -(-n // per)
parts = [b"\xdd" + struct.pack(">I", outer)]
left = n
while left > 0:
  k = min(per, left); parts.append(b"\xdd" + struct.pack(">I", k) + item * k); left -= k
data = b"".join(parts)[:index_lib.MAX_INDEX_BYTES]
def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
base = rss(); t0 = time.perf_counter()
try:
  index_lib.decode(data); out = "decoded"
except Exception as e:
  out = str(e)[-90:]
print(f"{sys.argv[1]} x{n}: {len(data) >> 20} MiB, {time.perf_counter()-t0:.2f} s, peak RSS +{rss()-base:.0f} MiB; {out}")
