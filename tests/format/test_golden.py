"""Golden checkpoints: every checkpoint an earlier ckpt wrote stays readable.

tests/golden/v<N>/<name>/ holds checkpoints written by the ckpt whose index
format version (``ckpt.format.index.VERSION``) was N, one per storage format and
layout (zarr, zarr3, ocdbt on a POSIX root; bucket: the object-store layout
with attempts, commit markers and commit records, kept as one file per key),
and ``expected.json``: what a restore must give back, bit for bit. They are
written by tests/golden/make_golden.py and never rewritten afterwards.

Each golden of every version found there is restored by today's code (from
a copy: a tmp directory, or a fresh memory:// store for the bucket layout)
with ``ckpt.load``, with ``Checkpointer.restore`` and no target, and with a
target of ShapeDtypeStructs (the saved shardings, and another mesh); every
leaf is compared with expected.json: container types, dtype, shape and raw
bytes, PRNG keys by their key data and implementation name, shardings; and
``all_steps``, ``latest_step``, ``metrics`` and ``host_state`` of each step.

The rule: bump ``ckpt.format.index.VERSION`` whenever the on-disk contract changes
(the index document, the files of a step, the commit protocol's objects),
run ``python -m tests.golden.make_golden`` to write the new version's
goldens beside the old ones, and keep every older version's goldens and the
readers they need. test_current_version_has_goldens fails until the current
VERSION has its goldens; a golden of an older version that no longer
restores bit-exact is a compatibility break, not a golden to regenerate.
"""

from __future__ import annotations

import base64
import hashlib
import json
import pathlib
import shutil

import jax
import ml_dtypes  # noqa: F401  (bfloat16 as a numpy dtype name)
import msgpack
from tests import sealed
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt.format import index as index_lib
from ckpt.format import index_codec
from ckpt.store import storage as storage_lib
from ckpt.errors import CorruptCheckpointError
from tests.golden import make_golden

GOLDEN_ROOT = pathlib.Path(__file__).resolve().parent.parent / "golden"
EXPECTED = "expected.json"
# Every golden directory of every version: adding v<N>/ adds its tests.
GOLDENS = sorted(p.parent for p in GOLDEN_ROOT.glob(f"v*/*/{EXPECTED}"))
IDS = [p.relative_to(GOLDEN_ROOT).as_posix() for p in GOLDENS]
_stores = iter(range(1 << 30))


def _version(golden: pathlib.Path) -> int:
  return int(golden.parent.name.removeprefix("v"))


def _expected(golden: pathlib.Path) -> dict:
  with open(golden / EXPECTED) as f:
    return json.load(f)


def _open_copy(golden: pathlib.Path, tmp_path: pathlib.Path) -> str:
  """A URL of a copy of ``golden`` (never the golden itself): a directory
  for a POSIX layout, a fresh memory:// store holding one key per file
  for the bucket layout."""
  ignore = shutil.ignore_patterns(EXPECTED)
  if _expected(golden)["layout"] == "posix":
    root = tmp_path / golden.name
    shutil.copytree(golden, root, ignore=ignore)
    return str(root)
  url = f"memory://golden-{_version(golden)}-{golden.name}-{next(_stores)}"
  store = storage_lib.Storage(url)
  files = [p for p in sorted(golden.rglob("*"))
           if p.is_file() and p.relative_to(golden).as_posix() != EXPECTED]
  assert files, f"{golden} holds no files"
  for p in files:
    store.write_bytes(p.relative_to(golden).as_posix(), p.read_bytes())
  return url


@pytest.fixture(params=GOLDENS, ids=IDS)
def golden(request, tmp_path):
  """(url of a copy, expected.json) of one golden checkpoint."""
  return _open_copy(request.param, tmp_path), _expected(request.param)


def _steps(exp: dict) -> list[int]:
  return sorted(int(s) for s in exp["steps"])


# ---- comparing a restored tree with expected.json --------------------------

def _array(desc: dict) -> np.ndarray:
  """The expected array of a description (its bytes checked first)."""
  data = base64.b64decode(desc["data"])
  assert hashlib.sha256(data).hexdigest() == desc["sha256"], (
      "expected.json is damaged: data and sha256 disagree")
  dtype = np.dtype(desc["dtype"]).newbyteorder("<")
  return np.frombuffer(data, dtype).reshape(tuple(desc["shape"]))


def _same_array(got: np.ndarray, desc: dict, where: str, out: list) -> None:
  want = _array(desc)
  if got.dtype.name != want.dtype.name or got.shape != want.shape:
    out.append(f"{where}: {got.dtype}{list(got.shape)}, expected "
               f"{want.dtype}{list(want.shape)}")
    return
  got = got.astype(want.dtype)  # little-endian, C order
  if got.tobytes() != want.tobytes():
    bad = np.flatnonzero(got.view(np.uint8) != want.view(np.uint8))
    out.append(f"{where}: {bad.size} of {want.nbytes} bytes differ (first "
               f"at byte {bad[0]}); sha256 {hashlib.sha256(got).hexdigest()}, "
               f"expected {desc['sha256']}")


def _python_value(desc: dict):
  kind, v = desc["type"], desc["value"]
  if kind == "float":
    return float.fromhex(v)
  if kind == "bytes":
    return base64.b64decode(v)
  return {"int": int, "bool": bool, "str": str}[kind](v)


def _check_leaf(got, desc: dict, where: str, shardings: dict | None,
                out: list) -> None:
  """One leaf; ``shardings`` (target restores): the sharding each jax leaf
  must have, by path; None: host values are expected."""
  kind = desc["kind"]
  want_sharding = shardings.get(where) if shardings is not None else None
  if kind == "python":
    value = _python_value(desc)
    if type(got) is not type(value) or got != value:
      out.append(f"{where}: {got!r} ({type(got).__name__}), expected "
                 f"{value!r} ({type(value).__name__})")
    return
  if kind == "keys":
    if not (isinstance(got, jax.Array) and
            jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key)):
      out.append(f"{where}: {type(got).__name__} "
                 f"{getattr(got, 'dtype', '')}, expected typed PRNG keys")
      return
    impl = jax.random.key_impl(got)
    impl = impl if isinstance(impl, str) else str(getattr(impl, "name", impl))
    if impl != desc["impl"] or list(got.shape) != desc["shape"]:
      out.append(f"{where}: {impl} keys of shape {list(got.shape)}, expected "
                 f"{desc['impl']} keys of shape {desc['shape']}")
      return
    _same_array(np.asarray(jax.random.key_data(got)), desc["key_data"],
                where, out)
  elif want_sharding is not None:  # a target restore into a jax.Array
    if not isinstance(got, jax.Array):
      out.append(f"{where}: {type(got).__name__}, expected a jax.Array")
      return
    _same_array(np.asarray(got), desc, where, out)
  elif kind == "array" or shardings is not None:  # into a numpy array
    if type(got) is not np.ndarray:
      out.append(f"{where}: {type(got).__name__}, expected numpy.ndarray")
      return
    _same_array(got, desc, where, out)
  elif kind == "numpy_scalar":
    if not isinstance(got, np.generic):
      out.append(f"{where}: {type(got).__name__}, expected a numpy scalar")
      return
    _same_array(np.asarray(got), desc, where, out)
  else:
    raise AssertionError(f"unknown leaf kind {kind!r} in expected.json")
  if want_sharding is not None and got.sharding != want_sharding:
    out.append(f"{where}: sharding {got.sharding}, expected {want_sharding}")


def compare(got, desc: dict, shardings: dict | None = None,
            where: str = "") -> list[str]:
  """Every difference between a restored tree and its description."""
  out: list[str] = []
  _compare(got, desc, shardings, where, out)
  return out


def _compare(got, desc: dict, shardings, where: str, out: list) -> None:
  (kind, want), = desc.items()
  here = where or "<root>"
  if kind == "leaf":
    _check_leaf(got, want, here, shardings, out)
  elif kind == "none":
    if got is not None:
      out.append(f"{here}: {type(got).__name__}, expected None")
  elif kind == "dict":
    if type(got) is not dict or set(got) != set(want):
      out.append(f"{here}: {type(got).__name__} with keys "
                 f"{sorted(got) if isinstance(got, dict) else '-'}, expected "
                 f"a dict with keys {sorted(want)}")
      return
    for k, child in want.items():
      _compare(got[k], child, shardings, f"{where}/{k}".lstrip("/"), out)
  elif kind in ("list", "tuple"):
    if type(got).__name__ != kind or len(got) != len(want):
      out.append(f"{here}: {type(got).__name__} of "
                 f"{len(got) if hasattr(got, '__len__') else '-'}, expected "
                 f"a {kind} of {len(want)}")
      return
    for i, (g, child) in enumerate(zip(got, want)):
      _compare(g, child, shardings, f"{where}/{i}".lstrip("/"), out)
  else:
    raise AssertionError(f"unknown node kind {kind!r} in expected.json")


# ---- targets ---------------------------------------------------------------

def _saved_sharding(desc: dict | None) -> NamedSharding:
  """The sharding an array was saved with (replicated for host leaves)."""
  if desc is None:
    return NamedSharding(Mesh(np.asarray(jax.devices()), ("all",)), P())
  n = int(np.prod(desc["mesh_shape"]))
  devices = np.asarray(jax.devices()[:n]).reshape(desc["mesh_shape"])
  spec = [tuple(p) if isinstance(p, list) else p for p in desc["spec"]]
  return NamedSharding(Mesh(devices, tuple(desc["mesh_axes"])), P(*spec))


def _moved_sharding(shape: list[int]) -> NamedSharding:
  """Another mesh than any golden's: (4, 2), the first dimension split
  over "a" where it divides."""
  mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("a", "b"))
  return NamedSharding(mesh, P("a") if shape and shape[0] % 4 == 0 else P())


def make_target(desc: dict, placement: str, where: str = "",
                shardings: dict | None = None):
  """(target tree, {path: sharding}): ShapeDtypeStructs with shardings,
  except 64-bit leaves without jax_enable_x64 (numpy arrays: restored as
  numpy) and python values (restored as saved)."""
  shardings = {} if shardings is None else shardings
  (kind, want), = desc.items()
  if kind == "none":
    return None, shardings
  if kind == "dict":
    return {k: make_target(v, placement, f"{where}/{k}".lstrip("/"),
                           shardings)[0] for k, v in want.items()}, shardings
  if kind in ("list", "tuple"):
    items = [make_target(v, placement, f"{where}/{i}".lstrip("/"),
                         shardings)[0] for i, v in enumerate(want)]
    return (items if kind == "list" else tuple(items)), shardings
  leaf = want
  if leaf["kind"] == "python":
    return _python_value(leaf), shardings
  if leaf["kind"] == "keys":
    shape = leaf["shape"]
    dtype = jax.eval_shape(
        lambda: jax.random.key(0, impl=leaf["impl"])).dtype
  else:
    shape, dtype = leaf["shape"], np.dtype(leaf["dtype"])
    if dtype.itemsize == 8 and not jax.config.jax_enable_x64:
      # jax would truncate 64-bit values: a numpy target restores them.
      return np.zeros(shape, dtype), shardings
  sharding = (_saved_sharding(leaf.get("sharding")) if placement == "saved"
              else _moved_sharding(shape))
  shardings[where] = sharding
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding), shardings


# ---- the tests -------------------------------------------------------------

def test_goldens_found():
  assert GOLDENS, f"no golden checkpoints under {GOLDEN_ROOT}/v*/*/{EXPECTED}"


def test_current_version_has_goldens():
  """Whoever bumps ckpt.format.index.VERSION writes its goldens (make_golden)."""
  here = make_golden.version_dir(GOLDEN_ROOT, index_lib.VERSION)
  names = {p.name for p in GOLDENS if p.parent == here}
  layouts = {_expected(here / n)["layout"] for n in names}
  formats = {_expected(here / n)["options"]["format"] for n in names}
  assert {"zarr", "zarr3", "ocdbt"} <= formats and layouts == {
      "posix", "bucket"}, (
          f"ckpt.format.index.VERSION is {index_lib.VERSION} but {here} holds "
          f"goldens {sorted(names)} (formats {sorted(formats)}, layouts "
          f"{sorted(layouts)}); run python -m tests.golden.make_golden")


@pytest.mark.parametrize("golden_dir", GOLDENS, ids=IDS)
def test_golden_is_of_its_version(golden_dir):
  """v<N>/ holds only what index format version N wrote."""
  exp = _expected(golden_dir)
  assert exp["index_version"] == _version(golden_dir)
  indexes = sorted(golden_dir.rglob(storage_lib.INDEX_NAME))
  assert len(indexes) == len(exp["steps"]), indexes
  for path in indexes:
    doc = sealed.unpackb(path.read_bytes(), raw=False)
    assert (doc["format"], doc["version"]) == ("ckpt", _version(golden_dir)), (
        path)


def test_load(golden):
  """ckpt.load, no target: host numpy values (typed keys as key arrays)."""
  url, exp = golden
  for step in _steps(exp):
    got = ckpt.load(url, step)
    assert not compare(got, exp["steps"][str(step)]["state"]), (
        "\n".join(compare(got, exp["steps"][str(step)]["state"])))
  latest = exp["steps"][str(_steps(exp)[-1])]["state"]
  problems = compare(ckpt.load(url), latest)
  assert not problems, "\n".join(problems)


def test_restore_without_target(golden):
  """Checkpointer.restore(target=None, verify=True), and the queries."""
  url, exp = golden
  with ckpt.Checkpointer(url) as c:
    assert c.all_steps() == _steps(exp)
    assert c.latest_step() == _steps(exp)[-1]
    for step in _steps(exp):
      want = exp["steps"][str(step)]
      problems = compare(c.restore(step, verify=True), want["state"])
      assert not problems, f"step {step}:\n" + "\n".join(problems)
      metrics = c.metrics(step)
      assert metrics == want["metrics"], step
      assert ({k: type(v) for k, v in metrics.items()} ==
              {k: type(v) for k, v in want["metrics"].items()}), metrics
      assert c.host_state(step) == want["host_state"], step
    assert c.host_state() == exp["steps"][str(_steps(exp)[-1])]["host_state"]


@pytest.mark.parametrize("placement", ["saved", "moved"])
def test_restore_with_target(golden, placement):
  """A target of ShapeDtypeStructs: the saved shardings, or another mesh."""
  url, exp = golden
  with ckpt.Checkpointer(url) as c:
    for step in _steps(exp):
      desc = exp["steps"][str(step)]["state"]
      target, shardings = make_target(desc, placement)
      got = c.restore(step, target=target)
      problems = compare(got, desc, shardings)
      assert not problems, f"step {step}:\n" + "\n".join(problems)


def _current_zarr_golden(tmp_path: pathlib.Path):
  """A copy of the current version's zarr golden: (root, latest step's
  state description, one chunk file of a stored float32 array)."""
  golden = make_golden.version_dir(GOLDEN_ROOT) / "zarr"
  root = pathlib.Path(_open_copy(golden, tmp_path))
  exp = _expected(golden)
  step = _steps(exp)[-1]
  step_dir = root / storage_lib.step_dirname(step)
  index = index_lib.decode((step_dir / storage_lib.INDEX_NAME).read_bytes())
  entry = next(e for e in index.leaves if isinstance(e, index_lib.ArrayEntry)
               and e.dtype == "float32")
  chunk = step_dir / entry.relpath / ".".join("0" * len(entry.shape))
  return root, step, exp["steps"][str(step)]["state"], chunk


def test_damaged_golden_fails(tmp_path):
  """The comparison (unverified) and every verified read (load, restore,
  the default) catch one flipped byte in a chunk (format zarr: raw chunks,
  checksums in .checksums/)."""
  root, step, desc, chunk = _current_zarr_golden(tmp_path)
  assert not compare(ckpt.load(root, step), desc)  # intact: equal
  data = bytearray(chunk.read_bytes())
  data[len(data) // 2] ^= 0x01
  chunk.write_bytes(bytes(data))
  problems = compare(ckpt.load(root, step, verify=False), desc)
  assert len(problems) == 1 and "1 of" in problems[0], problems
  with pytest.raises(CorruptCheckpointError, match="crc32c"):
    ckpt.load(root, step)
  with ckpt.Checkpointer(root) as c:
    with pytest.raises(CorruptCheckpointError):
      c.restore(step, verify=True)


# Optional leaf fields added to the index after the current version's
# goldens were written, without a version bump: readers of that version
# ignore them (index.decode reads a leaf's fields by name) and today's
# readers find them absent in its indexes (tests/restore/test_restore_as_saved.py).
# Left out of the comparison below; empty this set when VERSION is next
# bumped (the new goldens then hold these fields).
ADDED_WITHOUT_BUMP = frozenset()


def _index_schema(path: pathlib.Path) -> dict:
  """The fields of an index document, of its leaves' columns (version 2)
  and of each of its leaves."""
  doc = sealed.unpackb(path.read_bytes(), raw=False)
  columns = sorted(doc["leaves"]) if isinstance(doc["leaves"], dict) else []
  rows = (index_codec.rows(doc["leaves"]) if columns else doc["leaves"])
  leaves = {"/".join(e["path"]): (e["kind"],
                                  sorted(set(e) - ADDED_WITHOUT_BUMP),
                                  sorted(e.get("codec") or {}))
            for e in rows}
  return {"fields": sorted(doc), "version": doc["version"],
          "columns": columns, "leaves": leaves}


def test_generator_reproduces_current_goldens(tmp_path):
  """make_golden, run again, writes the same expected values, and indexes
  with the same fields as the current version's goldens: a field added to
  or dropped from the index is an on-disk change (bump VERSION)."""
  assert make_golden.main(["--out", str(tmp_path)]) == 0
  fresh_dir = make_golden.version_dir(tmp_path)
  current = make_golden.version_dir(GOLDEN_ROOT)
  for name in make_golden.GOLDENS:
    fresh, kept = _expected(fresh_dir / name), _expected(current / name)
    assert fresh["steps"] == kept["steps"], (
        f"{name}: make_golden.py now writes other values than the goldens "
        f"in {current}: restore its state, or bump VERSION")
    fresh_ix = sorted((fresh_dir / name).rglob(storage_lib.INDEX_NAME))
    kept_ix = sorted((current / name).rglob(storage_lib.INDEX_NAME))
    assert len(fresh_ix) == len(kept_ix)
    for a, b in zip(fresh_ix, kept_ix):
      assert _index_schema(a) == _index_schema(b), (
          f"{name}: today's index ({a.relative_to(tmp_path)}) has other "
          f"fields than the golden's ({b.relative_to(GOLDEN_ROOT)}): the "
          "on-disk contract changed; bump ckpt.format.index.VERSION, keep a reader "
          "for the old one and run python -m tests.golden.make_golden")
