"""Runs gcp-storage-emulator with two pieces of the GCS API it lacks.

``python -m tests.objectstore.gcs_emulator [--plain] start --port P ...``
(the emulator's own arguments follow).

1. ``objects.list`` ignores ``startOffset`` / ``endOffset`` (documented by
   the GCS JSON API, honoured by GCS) and lists the whole bucket.
   TensorStore lists key ranges with exactly these parameters (for
   ``KvStore.list`` and ``delete_range``) and trusts the answer, so against
   the plain emulator a listing returns keys of other directories with
   their first characters cut off, and a ``delete_range`` deletes them.
2. Downloads carry no ``x-goog-generation`` header. TensorStore then holds
   generation 0 for what it read, and the next conditional request built
   from it fails with "Malformed StorageGeneration": OCDBT's manifest
   update, and re-reads of cached zarr metadata in multi-process restores.

This launcher adds both (the listing filtered to the range, the header
from the emulator's own object record) and changes nothing else: objects,
uploads, reads and deletes are the emulator's. ``--plain`` runs the
emulator unchanged (the test that ckpt refuses a server that ignores the
listing range uses it). Left as they are: the emulator ignores
``ifGenerationMatch`` preconditions, and fails on empty uploads.
"""

from __future__ import annotations

import sys


def _add_missing_api() -> None:
  from gcp_storage_emulator.handlers import objects  # pylint: disable=g-import-not-at-top

  plain_ls = objects.ls

  class _InRange:
    """The emulator's storage, listing only names in [startOffset, endOffset)."""

    def __init__(self, storage, lo: str | None, hi: str | None):
      self._storage, self._lo, self._hi = storage, lo, hi

    def __getattr__(self, name):
      return getattr(self._storage, name)

    def get_file_list(self, *args, **kwargs):
      files, prefixes = self._storage.get_file_list(*args, **kwargs)
      files = [f for f in files
               if (self._lo is None or f["name"] >= self._lo)
               and (self._hi is None or f["name"] < self._hi)]
      return files, prefixes

  def ls(request, response, storage, *args, **kwargs):
    lo = (request.query.get("startOffset") or [None])[0]
    hi = (request.query.get("endOffset") or [None])[0]
    return plain_ls(request, response, _InRange(storage, lo, hi),
                    *args, **kwargs)

  plain_download = objects.download

  def download(request, response, storage, *args, **kwargs):
    plain_download(request, response, storage, *args, **kwargs)
    try:
      obj = storage.get_file_obj(request.params["bucket_name"],
                                 request.params["object_id"])
    except Exception:  # pylint: disable=broad-except
      return  # not found: the emulator's own answer stands
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj["metageneration"])

  # Before the server module is imported: it builds its routes from these
  # functions at import time.
  objects.ls = ls
  objects.download = download


def main(argv: list[str]) -> None:
  if argv and argv[0] == "--plain":
    argv = argv[1:]
  else:
    _add_missing_api()
  from gcp_storage_emulator import __main__ as emulator  # pylint: disable=g-import-not-at-top
  emulator.main(argv)


if __name__ == "__main__":
  main(sys.argv[1:])
