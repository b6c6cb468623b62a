"""The decode of a hostile index of one msgpack item repeated, at the cap:

    python -m scripts.untrusted.dense ITEM_HEX [--bytes N]

builds an index of ``N`` bytes (default: ``MAX_INDEX_BYTES``, the cap) that
is one item (``c0`` nil, ``90`` empty list, ``81a0c0`` one-entry map,
``a26162`` 2-byte string, ``cd0100`` uint16) repeated in nested arrays of
2^20 - 1, and prints ``ITEM xCOUNT: <MiB> MiB, <wall> s, cpu <cpu> s, peak
RSS +<MiB> MiB; <outcome>`` of ``ckpt.format.index.decode`` on it, measured
by scripts/benchlib/measure.py. Run one item per fresh process
(``python -m scripts.untrusted`` does).
"""

from __future__ import annotations

import argparse
import struct

from scripts.benchlib import measure

ITEMS = ("c0", "90", "81a0c0", "a26162", "cd0100")
PER_ARRAY = (1 << 20) - 1


def hostile_index(item: bytes, nbytes: int) -> tuple[bytes, int]:
  """(about ``nbytes`` of ``item`` repeated in nested arrays, its count)."""
  n = (nbytes - 64) // len(item)
  parts = [b"\xdd" + struct.pack(">I", -(-n // PER_ARRAY))]
  left = n
  while left > 0:
    k = min(PER_ARRAY, left)
    parts.append(b"\xdd" + struct.pack(">I", k) + item * k)
    left -= k
  return b"".join(parts)[:nbytes], n


def run(item_hex: str, nbytes: int | None = None) -> str:
  """The line this item prints."""
  from ckpt.format import index as index_lib  # pylint: disable=g-import-not-at-top
  data, n = hostile_index(bytes.fromhex(item_hex),
                          nbytes or index_lib.MAX_INDEX_BYTES)
  m = measure.measure()
  try:
    with m:
      index_lib.decode(data)
    out = "decoded"
  except Exception as e:  # pylint: disable=broad-except
    out = str(e)[-90:]
  return (f"{item_hex} x{n}: {len(data) / 2**20:.0f} MiB, {m.wall_s:.2f} s, "
          f"cpu {m.cpu_s:.2f} s, peak RSS +{m.extra_rss / 2**20:.0f} MiB; "
          f"{out}")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("item", help=f"msgpack item as hex, e.g. {', '.join(ITEMS)}")
  ap.add_argument("--bytes", type=int, default=None,
                  help="size of the index (default: MAX_INDEX_BYTES)")
  args = ap.parse_args()
  print(run(args.item, args.bytes), flush=True)


if __name__ == "__main__":
  main()
