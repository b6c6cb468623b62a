"""The parts of one ``Checkpointer`` (ckpt/checkpointer.py), built and wired
once from its options: each part is handed the others it uses, and nothing
else. ``Parts.build`` opens the storage (within ``query_timeout_s``), then
builds the background loop, the save in flight, the known steps, the save
history, the rounds, retention, the root metadata file, the saver, the
restorer, the save decision, the queries, the call of a decided save and
the persistent tier's side (``TierSide``, for a MultiTierCheckpointer).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from ckpt.commit import lease as lease_lib
from ckpt.face import decision as decision_lib
from ckpt.face import history as history_lib
from ckpt.face import inflight as inflight_lib
from ckpt.face import known as known_lib
from ckpt.face import loop as loop_lib
from ckpt.face import options as options_lib
from ckpt.face import queries as queries_lib
from ckpt.face import restorer as restorer_lib
from ckpt.face import retention as retention_lib
from ckpt.face import root_meta
from ckpt.face import rounds as rounds_lib
from ckpt.face import save_call as save_call_lib
from ckpt.face import saver as saver_lib
from ckpt.face import tier_side as tier_side_lib
from ckpt.save import reuse as reuse_lib
from ckpt.store import deadline as deadline_lib
from ckpt.store import storage as storage_lib


@dataclasses.dataclass(frozen=True)
class Parts:
  """The parts of one Checkpointer, each the owner of its state."""
  storage: storage_lib.Storage
  rounds: rounds_lib.Rounds
  inflight: inflight_lib.InFlightSave
  known: known_lib.KnownSteps
  history: history_lib.SaveHistory
  loop: loop_lib.BackgroundLoop
  retention: retention_lib.Retention
  root_metadata: root_meta.RootMetadataFile
  saver: saver_lib.Saver
  restorer: restorer_lib.Restorer
  queries: queries_lib.Queries
  save_call: save_call_lib.SaveCall
  tier_side: tier_side_lib.TierSide

  @classmethod
  def build(cls, directory: str | os.PathLike,
            options: options_lib.Options, settings: options_lib.Settings,
            on_exit: Callable[[], None],
            lease_seen: Callable[[], lease_lib.Sightings]) -> "Parts":
    """The parts of a Checkpointer of ``directory`` with ``options``
    (checked: ``settings``). ``on_exit``: its ``close`` (run at the
    interpreter's exit); ``lease_seen``: its ``lease_seen`` (it may be
    replaced)."""
    timeouts, save = settings.timeouts, settings.save
    storage = deadline_lib.call(
        timeouts.query_deadline(), storage_lib.Storage, directory,
        options.storage_options)
    reuser = reuse_lib.Reuser(options.reuse_unchanged, storage,
                              options.format,
                              copies=1 if options.keep == 1 else 2)
    rounds = rounds_lib.Rounds(storage.spec, storage.url, timeouts)
    inflight = inflight_lib.InFlightSave()
    known = known_lib.KnownSteps(storage)
    history = history_lib.SaveHistory()
    loop = loop_lib.BackgroundLoop("Checkpointer", on_exit=on_exit)
    retention = retention_lib.Retention(
        storage, settings.policy, known, rounds.key_base, timeouts.save_s,
        loop)
    root_metadata = root_meta.RootMetadataFile(storage,
                                               settings.root_metadata)
    saver = saver_lib.Saver(save, storage, reuser, rounds, known, retention,
                            history, inflight, loop, lease_seen,
                            root_metadata)
    restorer = restorer_lib.Restorer(settings.restore, storage, rounds, known,
                                     retention, inflight, loop)
    decision = decision_lib.SaveDecision(settings.decision, save.clock,
                                         inflight)
    queries = queries_lib.Queries(
        storage, settings.policy, settings.schedule, known, retention,
        history, rounds, inflight, loop, decision)
    save_call = save_call_lib.SaveCall(loop, saver, restorer)
    tier_side = tier_side_lib.TierSide(known, retention, rounds, inflight,
                                       queries, save_call)
    return cls(storage, rounds, inflight, known, history, loop, retention,
               root_metadata, saver, restorer, queries, save_call, tier_side)
