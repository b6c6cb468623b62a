"""The read-only queries of the public Checkpointer, and ``delete``.

``QueryCalls`` is the one base of ``ckpt.Checkpointer`` (ckpt/checkpointer.py):
the public query methods with their docstrings, each handing the call to the
Checkpointer's parts (``ckpt.face.queries.Queries``), and ``directory``. It
holds no state of its own; it is a separate module so that the public class,
with every docstring, stays within the module size limit.

The read-only queries (``all_steps``, ``latest_step``, ``best_step``,
``metrics``, ``metadata``, ``host_state``, ``should_save``) may be called by
any process, alone or with others: each reads the directory itself (within
``query_timeout_s``), with no agreement round, so "log from rank 0" code
never leaves the other processes waiting. ``delete`` is collective.
"""

from __future__ import annotations

import os
from typing import Any

from ckpt import metadata as metadata_lib
from ckpt.face import queries as queries_lib
from ckpt.face import root_meta
from ckpt.face import rounds as rounds_lib
from ckpt.store import storage as storage_lib


class QueryCalls:
  """The queries of ``ckpt.Checkpointer`` (see the module docstring); the
  Checkpointer makes ``_queries``."""

  _queries: queries_lib.Queries
  _rounds: rounds_lib.Rounds
  _root_metadata: root_meta.RootMetadataFile
  storage: storage_lib.Storage

  @property
  def directory(self) -> Any:
    """The checkpoint root: an ``etils.epath.Path`` for a local directory
    (a path or ``file://`` URL, made absolute), as Orbax's
    ``CheckpointManager.directory``; the URL string for ``gs://``, ``s3://``
    and ``memory://`` (ckpt reads those with TensorStore, not epath).

    Never raises. Not collective (no I/O).
    """
    # pylint: disable=g-import-not-at-top
    from etils import epath
    url = self.storage.url
    if self.storage.is_posix:
      path = url[len("file://"):] if url.startswith("file://") else url
      return epath.Path(os.path.abspath(path))
    return url

  def all_steps(self) -> list[int]:
    """The committed steps of the directory, in increasing order.

    Any process, alone or with others: it lists the directory itself (on
    process 0, once its retention pass after the last save is done).
    Not collective.

    Raises:
      StoreTimeoutError: the store did not answer within ``query_timeout_s``.
      CheckpointError: the directory cannot be listed.
    """
    return self._queries.all_steps()

  def latest_step(self) -> int | None:
    """The newest committed step, or None when there is none.

    Any process, like ``all_steps``; raises what it raises. Not collective.
    """
    steps = self.all_steps()
    return steps[-1] if steps else None

  def best_step(self) -> int | None:
    """The committed step with the best ``best_metric`` (or ``best_fn``)
    value under ``best_mode``, among the committed steps that have it; ties
    go to the newest step; NaN never counts as best. None when no committed
    step has the metric, and without ``best_metric``/``best_fn`` (Orbax
    returns ``latest_step()`` then). Any process: it reads each step's
    metrics itself (cached, as retention's). Not collective.

    Raises ``StoreTimeoutError`` / ``CheckpointError`` as ``all_steps``.
    """
    return self._queries.best_step()

  def metrics(self, step: int) -> dict[str, float | int]:
    """The metrics saved with ``step``: ``{"a/b": number}``, ints as ints.

    Args:
      step: a committed step.

    Raises:
      CheckpointNotFoundError: ``step`` is not committed (a save in flight is
        not: ``wait_until_finished()`` first).
      StoreTimeoutError: the store did not answer within ``query_timeout_s``.

    Any process: it reads the step's record or index itself (cached).
    Not collective.
    """
    return self._queries.metrics(step)

  def reload(self) -> None:
    """Forgets what this Checkpointer cached about saved steps (their
    metrics and save times), so the next query reads them from the
    directory again: after another job changed it. No I/O; safe to call on
    any process.

    Never raises. Not collective.
    """
    self._queries.forget()

  def root_metadata(self) -> "root_meta.RootMetadata":
    """The directory's root metadata: ``.custom_metadata``, the dict given
    as ``Checkpointer(custom_metadata=...)`` by the run that first saved
    into it (written once, by process 0, with that first save; sealed;
    never deleted by retention). Before any save wrote it, the dict this
    Checkpointer was given ({} if none). A reopen with another dict keeps
    the stored one (one WARNING at its first save). Any process: it reads
    the file itself. Not collective.

    Raises:
      CorruptCheckpointError: the file is damaged (its crc32c, its JSON).
      StoreTimeoutError: the store did not answer within ``query_timeout_s``.
    """
    return self._rounds.local(self._root_metadata.current)

  def should_save(self, step: int) -> bool:
    """Whether ``save(step, ...)`` writes ``step`` (``save_interval_steps``).

    True for every step without ``save_interval_steps``; with it, for
    multiples of it (step 0 included), for the step ``reached_preemption``
    said True for, and for the first step of a run whose directory holds no
    checkpoint yet (as Orbax's CheckpointManager). The first two are pure
    functions of the step and of jax's agreed preemption step, so every
    process computes the same answer with no I/O. The third needs the
    directory: the first call that reaches it lists it (on the calling
    process); after that (or after any save) it is known. Any process may
    call it; ``save`` itself agrees on whether to save. Not collective.

    ``save_on_steps``: those steps are accepted too. ``should_save_fn(step,
    last_saved_step)``: a step it accepts is accepted too (Orbax ignores
    ``save_interval_steps`` and ``save_on_steps`` when it is given; ckpt
    takes any of them: give only ``should_save_fn`` for Orbax's behaviour,
    then without the first-step rule, as Orbax). ``last_saved_step`` is the
    step of this Checkpointer's last save, or before any the newest
    committed step (None: none; listed the first time it is needed). The
    function runs on every process that calls, with no round: it must be
    deterministic (a pure function of its two
    arguments, not of the clock or of process-local state) and must not
    raise, or processes that disagree wait for each other in ``save``
    until ``barrier_timeout_s``.

    ``save_interval_secs`` / ``skip_while_saving``: a step the rules above
    refuse is accepted once that many seconds passed since the last save,
    and any step is refused while the previous save is still writing
    (never the preemption step); both decided by process 0 (its clock, its
    save in flight) in one agreement round, so with either option this
    call is collective: every process calls it, as it calls ``save``. It
    does not restart the interval (``save`` does). Without any rule but
    ``save_interval_secs`` there is no first-step save (as Levanter: the
    interval runs from when the Checkpointer was made).

    Args:
      step: the step a ``save`` would get.

    Raises:
      StoreTimeoutError: the first-step rule's one listing did not answer.
    """
    return self._queries.should_save(step, agreed=False)

  def last_saved_step(self, *, agreed: bool = True) -> int | None:
    """``should_save_fn``'s ``last_saved_step``: the step of this
    Checkpointer's last save, or before any the newest committed step
    (None: none).

    Args:
      agreed: True: the first time it is needed, process 0 lists the
        directory in one agreement round (collective) and every process
        keeps the answer; False: this process lists it (any process).

    Raises:
      StoreTimeoutError: the listing did not answer within ``query_timeout_s``.
    """
    return self._queries.last_saved_step(agreed)

  def delete(self, step: int) -> None:
    """Deletes the committed ``step``, atomically (readers see it whole or
    not at all, as retention's deletions).

    Refused (``CheckpointError``) for the step of a save still in flight
    (``wait_until_finished()`` first) and for a step being restored or
    read by live ``restore(lazy=True)`` leaves; ``CheckpointNotFoundError``
    if it is not committed. Unlike retention it may delete the newest step.
    Collective: process 0 decides and deletes, every process gets the same
    result or error.

    Args:
      step: the committed step to delete.

    Raises:
      CheckpointError: a save of ``step`` in flight, or the step being read.
      CheckpointNotFoundError: ``step`` is not committed.
    """
    self._queries.delete(step)

  def metadata(self, step: int | None = None) -> "metadata_lib.Metadata":
    """What ``step`` (default: latest) holds, without reading its data.

    ``.tree`` is the saved tree with a ``jax.ShapeDtypeStruct`` (the saved
    dtype, no sharding) per array leaf and the inline values as saved;
    ``.shardings`` holds each array's saved sharding by leaf path (a
    ``SavedSharding``: mesh axis names and sizes, PartitionSpec,
    ``.to_sharding(devices=None)``); also
    ``.step``, ``.time``, ``.metrics``. ``ckpt.abstract_target(metadata,
    mesh, rules)`` turns it into a restore target for any mesh. Any
    process: it picks the step and reads its index itself. Not collective.

    Args:
      step: a committed step, or None for the latest.

    Raises:
      CheckpointNotFoundError: no such committed step (or none at all).
      CorruptCheckpointError: its index is unreadable or invalid.
    """
    return metadata_lib.from_index(self._queries.index(step))

  def host_state(self, step: int | None = None) -> Any:
    """This process's host_state saved with ``step`` (default: latest).

    The calling process picks the step and reads its index (how many
    processes' host_state it holds; whether the index holds every process's
    host_state itself, as older indexes do), then its own file,
    ``<step>/.host_state/<process>.msgpack``. A step saved without
    host_state (None on every process; an import of an Orbax step without
    per-process items) holds none: None, on any number of processes.

    Args:
      step: a committed step, or None for the latest.

    Raises:
      CheckpointNotFoundError: no such committed step.
      CheckpointError: the step holds host_state for another number of
        processes (naming both counts).

    Any process (each reads its own part; with ``step=None`` each asks
    for the newest step itself: pass ``last_restore_step`` to read the
    step a restore returned). Not collective.
    """
    return self._queries.host_state(step)
