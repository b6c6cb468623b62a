"""The manifest of a local step (ckpt/tiers/local_tier.py): its format and
version, the data files it describes, ``check_manifest`` (every field checked
before any is used, so a damaged manifest is a clean CorruptCheckpointError
naming the file and field) and ``mismatch`` (whether the shards a manifest
records are those a target's shardings ask for); ``box_index``, a shard's box.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckpt.errors import CorruptCheckpointError

FORMAT = "ckpt-local-tier"
VERSION = 3   # 2: crc32c of every shard and of host.msgpack, file sizes, owner
# 3: leaves named as the persistent tier names them ("params/w"); host.msgpack
# holds each stored leaf's dtype and PRNG implementation, and host values
# encoded as the persistent tier's index encodes inline values
MAX_MANIFEST_BYTES = 32 << 20   # as MAX_INDEX_BYTES of the persistent tier
DATA_FILES = {"own": "own.bin", "partner": "partner.bin"}


def box_index(idx, shape) -> tuple:
  return tuple((s.start or 0, shape[d] if s.stop is None else s.stop)
               for d, s in enumerate(idx))



def _is_int(v, lo: int = 0, hi: int = 1 << 62) -> bool:
  return type(v) is int and lo <= v < hi


def check_manifest(m: Any, step: int, pid: int, path: str) -> None:
  """Raises CorruptCheckpointError unless ``m`` is a manifest of this
  version for ``step`` of process ``pid`` whose shards all lie within the
  data files it records (no field is trusted before this)."""
  def bad(where: str, want: str, got: Any) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"local step {step}: {path} is not a manifest of the local tier: "
        f"{where}: expected {want}, found {str(got)[:200]!r}")

  if not isinstance(m, dict):
    raise bad("the top level", "an object", type(m).__name__)
  for k, want in (("format", FORMAT), ("version", VERSION), ("step", step),
                  ("process", pid)):
    if k not in m:
      raise bad(k, repr(want), "nothing (missing)")
    if m[k] != want or type(m[k]) is not type(want):
      raise bad(k, repr(want), m[k])
  for k, lo in (("process_count", 1), ("local_devices", 1), ("partner_src", 0)):
    if not _is_int(m.get(k), lo, 1 << 20):
      raise bad(k, f"an int >= {lo}", m.get(k, "nothing (missing)"))
  if m["partner_src"] >= m["process_count"]:
    raise bad("partner_src", f"< process_count {m['process_count']}",
              m["partner_src"])
  if not isinstance(m.get("owner"), str):
    raise bad("owner", "the persistent tier's URL", m.get("owner"))
  if not (isinstance(m.get("host_names"), list) and
          all(isinstance(n, str) for n in m["host_names"])):
    raise bad("host_names", "a list of leaf names", m.get("host_names"))
  files = m.get("files")
  names = {"host.msgpack", *DATA_FILES.values()}
  if (not isinstance(files, dict) or set(files) != names or
      not all(_is_int(v) for v in files.values())):
    raise bad("files", f"the sizes of {sorted(names)}", files)
  crcs = m.get("crc32c")
  if not (isinstance(crcs, dict) and _is_int(crcs.get("host.msgpack"), 0,
                                               1 << 32)):
    raise bad("crc32c", "the crc32c of host.msgpack", crcs)
  for part, fname in DATA_FILES.items():
    entries = m.get(part)
    if not isinstance(entries, dict):
      raise bad(part, "an object of leaves", entries)
    for name, e in entries.items():
      where = f"{part} leaf {name}"
      if not isinstance(e, dict):
        raise bad(where, "an object", e)
      shape = e.get("shape")
      if not (isinstance(shape, list) and len(shape) <= 64 and
              all(_is_int(d) for d in shape)):
        raise bad(f"{where} shape", "a list of sizes", shape)
      try:
        dt = np.dtype(e.get("dtype"))
      except (TypeError, ValueError):
        dt = None
      if dt is None or dt.hasobject or dt.itemsize == 0:
        raise bad(f"{where} dtype", "a numeric dtype", e.get("dtype"))
      shards, slots = e.get("shards"), e.get("slots")
      if not isinstance(shards, list):
        raise bad(f"{where} shards", "a list", shards)
      if not (isinstance(slots, list) and len(slots) == m["local_devices"] and
              all(_is_int(j, 0, len(shards)) for j in slots)):
        raise bad(f"{where} slots", f"{m['local_devices']} shard numbers",
                  slots)
      for k, sh in enumerate(shards):
        ok = (isinstance(sh, list) and len(sh) == 5 and
              isinstance(sh[0], list) and len(sh[0]) == len(shape) and
              all(isinstance(b, list) and len(b) == 2 and _is_int(b[0]) and
                  _is_int(b[1]) and b[0] <= b[1] <= d
                  for b, d in zip(sh[0], shape)) and
              _is_int(sh[1]) and _is_int(sh[2]) and
              sh[3] == [b[1] - b[0] for b in sh[0]] and
              sh[2] == int(np.prod(sh[3], dtype=np.int64)) * dt.itemsize and
              sh[1] + sh[2] <= files[fname] and _is_int(sh[4], 0, 1 << 32))
        if not ok:
          raise bad(f"{where} shard {k}", "[index, offset, bytes, shape, "
                    f"crc32c] within {fname} ({files[fname]} bytes)", sh)


def mismatch(entries: dict, tsig: dict, devices) -> str:
  for name, (shape, imap) in tsig.items():
    e = entries.get(name)
    if e is None:
      return f"leaf {name} is not in the local tier"
    if list(e["shape"]) != shape:
      continue  # the restore refuses it as a Checkpointer does
    for j, d in enumerate(devices):
      if d not in imap:
        return f"leaf {name} is not on every device in the target ({d})"
      want = box_index(imap[d], shape)
      have = tuple(tuple(x) for x in e["shards"][e["slots"][j]][0])
      if want != have:
        return (f"leaf {name} is sharded differently from the save: saved "
                f"in shards of {_extent(have)}, the target's are "
                f"{_extent(want)} (device {d.id}: saved box {list(have)}, "
                f"target box {list(want)})")
  return ""


def _extent(box) -> list[int]:
  """A shard's shape, from its box."""
  return [int(b) - int(a) for a, b in box]


def covered(entries: dict, tsig: dict, devices) -> bool:
  """Whether the shards a part records hold every byte each of
  ``devices`` needs for the target (``tsig``, as ``mismatch`` takes it),
  in whatever boxes they were saved: then this process can restore its
  part onto the target's shardings from its own shards (a reshard, no
  exchange). Shards of a NamedSharding are equal or disjoint, so a box is
  covered when its intersections with the distinct saved boxes add up to
  it."""
  for name, (shape, imap) in tsig.items():
    e = entries.get(name)
    if e is None:
      return False
    if list(e["shape"]) != shape:
      continue  # the restore refuses it as a Checkpointer does
    saved = {tuple(tuple(x) for x in sh[0]) for sh in e["shards"]}
    for d in devices:
      if d not in imap:
        return False
      want = box_index(imap[d], shape)
      need = int(np.prod([b - a for a, b in want]))
      got = sum(int(np.prod([max(0, min(b, hb) - max(a, ha))
                             for (a, b), (ha, hb) in zip(want, have)]))
                for have in saved)
      if got != need:
        return False
  return True
