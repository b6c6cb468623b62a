"""reuse_unchanged=True in the writer process (writer="process", a disk).

The writer process links unchanged chunks exactly as the thread writer
does: with the same ``Reuser`` and ``SaveReuse`` (ckpt/save/reuse.py),
owned by the writer process, which lives across its trainer's saves. So
each chunk is compared by its 128-bit hash, linked only from the step
the thread would link from, only once its file is found still what was
stored (its stat at every link, its bytes again at every
``REREAD_EVERY``-th link, ckpt/save/reuse_source.py), and the step linked
from is checked to be still this job's before the first link and after
the last. A new writer process (the first save, or after one died)
starts from the steps' ``.reuse`` records, as a restarted job does.

What the writer cannot do: link the boxes of the very jax.Array the
previous step stored without staging them (it never sees the trainer's
arrays: every box is staged and hashed), and hold leaves on a bucket
(the processes agree on those in a round through jax.distributed; the
Checkpointer refuses that combination).

Call sequence (one save at a time): ``begin(storage, begin_message)``
(None: no reuse), then the ``SaveReuse``'s ``check_source`` before the
first box and after the last, ``write_box`` per box, ``record_file``;
``committed(reuse)`` once the step is committed.
"""

from __future__ import annotations

import asyncio
import threading
import types
from typing import Any

from ckpt.save import reuse as reuse_lib
from ckpt.store import storage as storage_lib


def leaves_message(plan: Any) -> list[dict | None]:
  """The trainer's side: what the writer's reuse needs of each leaf of
  ``plan`` (None: not a stored array)."""
  out = []
  for lp in plan.leaves:
    e = lp.entry
    if lp.layout is None or lp.packed:
      out.append(None)
      continue
    out.append({"relpath": e.relpath, "shape": list(e.shape),
                "dtype": str(e.dtype), "chunks": list(e.chunks),
                "codec": dict(e.codec), "layout": list(lp.layout.chunks)})
  return out


def _plan(m: dict) -> Any:
  """The plan as SaveReuse reads it, from the ``begin`` message: the
  format, the checksum codec and each leaf's entry (no arrays)."""
  leaves = []
  for d in m["reuse_leaves"]:
    if d is None:
      leaves.append(types.SimpleNamespace(layout=None, packed=False,
                                          entry=None, source=None))
      continue
    entry = types.SimpleNamespace(
        relpath=d["relpath"], shape=tuple(d["shape"]), dtype=d["dtype"],
        chunks=tuple(d["chunks"]), codec=dict(d["codec"]))
    leaves.append(types.SimpleNamespace(
        layout=types.SimpleNamespace(chunks=tuple(d["layout"])),
        packed=False, entry=entry, source=None))
  fmt = m["storage_format"]
  checksum = m["reuse_checksum"]
  codec = types.SimpleNamespace(resolved_checksum=lambda _fmt: checksum)
  options = types.SimpleNamespace(storage_format=fmt, codec=codec,
                                  max_item_bytes=None)
  return types.SimpleNamespace(options=options, leaves=leaves, borrow=False)


class WriterReuser:
  """The writer process's reuse over the saves it writes."""

  def __init__(self):
    self._reuser: reuse_lib.Reuser | None = None
    self._key: tuple | None = None

  def begin(self, storage: storage_lib.Storage, m: dict
            ) -> reuse_lib.SaveReuse | None:
    """Blocking: the reuse of the save ``m`` (a ``begin`` message)."""
    copies = m.get("reuse_copies")
    if not copies:
      return None
    key = (storage.url, m["storage_format"], copies)
    if self._reuser is None or self._key != key:
      self._reuser = reuse_lib.Reuser(True, storage, m["storage_format"],
                                      copies)
      self._key = key
    if not self._reuser.enabled:
      return None
    return self._reuser.begin(_plan(m), m["step"], m["token"], m["work_dir"],
                              m["process"], m["processes"])

  def committed(self, reuse: reuse_lib.SaveReuse | None) -> None:
    if self._reuser is not None:
      self._reuser.committed(reuse)


class LoopThread:
  """One event loop on a thread of its own, which runs every
  ``SaveReuse.write_box`` of a save, as the thread writer's one loop does
  (the SaveReuse is then changed from one thread only)."""

  def __init__(self):
    self.loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self.loop.run_forever,
                                    name="ckpt-writer-reuse", daemon=True)
    self._thread.start()

  def run(self, coro) -> Any:
    """Blocking: ``coro`` run on the loop (in the caller's context: its
    deadline); its result."""
    return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

  def close(self) -> None:
    self.loop.call_soon_threadsafe(self.loop.stop)
    self._thread.join()
    self.loop.close()
