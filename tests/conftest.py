"""Shared fixtures for the single-process suite.

The environment is set before jax is imported anywhere: 8 CPU devices in one
process, so sharded, replicated and single-device arrays are all real.
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses  # noqa: E402
import faulthandler  # noqa: E402
import itertools  # noqa: E402
import typing  # noqa: E402

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

_memory_names = itertools.count()

# pytest-timeout (signal method) fails a test stuck in Python after 300 s;
# one stuck in native code never returns to Python, and the whole run would
# stall until CI's limit. scripts/test sets CKPT_HANG_DIR, a directory: each
# test process (the one process, or each pytest-xdist worker) keeps "<pid>"
# there, naming the test it runs; after HANG_EXIT_S in one test, every
# thread's stack goes there and that process ends (under xdist, the worker:
# xdist reports the test as crashed and starts another worker); scripts/test
# prints it and fails the run (a hang is a bug, never retried).
HANG_EXIT_S = float(os.environ.get("CKPT_HANG_EXIT_S", 420))
_hang_dump = None


def _hung_before(directory: str, nodeid: str) -> bool:
  """Whether an earlier test process of this run hung in this test.

  Under xdist, a crashed worker's file of tests goes back to the queue with
  the test it crashed in, so the hung test would run again on the next
  worker: it fails at once instead (a hang is never retried).
  """
  own = str(os.getpid())
  for name in os.listdir(directory):
    if name == own:
      continue
    try:
      with open(os.path.join(directory, name)) as f:
        text = f.read(1 << 16)
    except OSError:
      continue
    if text.startswith(f"running {nodeid} (limit") and "\nTimeout (" in text:
      return True
  return False


def pytest_runtest_setup(item):
  directory = os.environ.get("CKPT_HANG_DIR")
  if directory and _hung_before(directory, item.nodeid):
    pytest.fail(f"{item.nodeid} hung in an earlier test process of this run "
                "(stacks in scripts/test's log); a hang is not retried",
                pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # pylint: disable=unused-argument
  global _hang_dump
  directory = os.environ.get("CKPT_HANG_DIR")
  if directory and _hang_dump is None:
    _hang_dump = open(  # pylint: disable=consider-using-with
        os.path.join(directory, str(os.getpid())), "w")
  if _hang_dump is not None:
    _hang_dump.seek(0)
    _hang_dump.truncate()
    _hang_dump.write(f"running {item.nodeid} (limit {HANG_EXIT_S} s)\n")
    _hang_dump.flush()
    faulthandler.dump_traceback_later(HANG_EXIT_S, exit=True, file=_hang_dump)
  try:
    yield
  finally:
    if _hang_dump is not None:
      faulthandler.cancel_dump_traceback_later()
      _hang_dump.seek(0)
      _hang_dump.truncate()


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
  if jax.device_count() != 8:
    pytest.exit(f"expected 8 CPU devices, found {jax.devices()}; jax was "
                "imported before tests/conftest.py set XLA_FLAGS", returncode=2)


@pytest.fixture
def rng(request):
  """A numpy Generator seeded from the test's name (stable, but per test)."""
  seed = sum(request.node.nodeid.encode()) * 7919 % (2**32)
  return np.random.default_rng(seed)


@pytest.fixture
def ckpt_dir(tmp_path):
  """A fresh checkpoint root on the local disk (not created yet)."""
  return tmp_path / "ckpts"


@pytest.fixture
def tmpfs(tmp_path):
  """``tmpfs("8m")``: a fresh tmpfs of that size, unmounted after the test
  (a real full disk; mounting needs root, as on the development machines
  and CI, else the test is skipped)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  mounted = []

  def mount(size: str):
    mnt = tmp_path / f"tmpfs{len(mounted)}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                        str(mnt)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
      pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    mounted.append(mnt)
    return mnt

  yield mount
  for mnt in mounted:
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def memory_url():
  return f"memory://ckpt-test-{os.getpid()}-{next(_memory_names)}"


@pytest.fixture
def make_ckptr(ckpt_dir):
  """``make_ckptr(**kwargs)`` opens a Checkpointer (on ckpt_dir by default)
  and closes every one it opened when the test ends."""
  import ckpt  # pylint: disable=g-import-not-at-top
  opened = []

  def make(directory=None, **kwargs):
    c = ckpt.Checkpointer(ckpt_dir if directory is None else directory,
                          **kwargs)
    opened.append(c)
    return c

  yield make
  for c in opened:
    try:
      c.close()
    except Exception:  # a test that expected a failure may leave one behind
      pass


def mesh(shape=(2, 4), names=("data", "model"), devices=None):
  """A mesh over the 8 CPU devices (or ``devices``)."""
  devs = np.asarray(devices if devices is not None else jax.devices())
  return Mesh(devs[:int(np.prod(shape))].reshape(shape), names)


def named(mesh_, *spec):
  return NamedSharding(mesh_, P(*spec))


def sharded(x: np.ndarray, sharding) -> jax.Array:
  """A jax.Array holding ``x`` laid out by ``sharding`` (one callback per
  device, so every shard is a real, separate buffer)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def random_array(rng, shape, dtype=np.float32):
  """Random data of any dtype ckpt stores (never a constant array)."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return rng.random(shape) < 0.5
  if np.issubdtype(dtype, np.integer):
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -1000), min(info.max, 1000), size=shape,
                        dtype=dtype)
  if dtype == np.dtype(ml_dtypes.bfloat16):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
  return rng.standard_normal(shape).astype(dtype)


@pytest.fixture
def mesh8():
  """A (data=2, model=4) mesh over the 8 devices."""
  return mesh()


# Custom pytree nodes as users have them.

class AdamState(typing.NamedTuple):  # optax-style
  count: typing.Any
  mu: typing.Any
  nu: typing.Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:  # flax.struct-style
  params: typing.Any
  opt_state: typing.Any
  step: typing.Any
  tag: str = dataclasses.field(default="run", metadata=dict(static=True))


@pytest.fixture(scope="module")
def arrays_only():
  """Every array leaf stored as a TensorStore array, none packed
  (ckpt/save/pack.py): for the tests of the array path that use small arrays.
  Module-scoped, so module-scoped checkpoints are saved under it too (use
  it from an autouse fixture of the module)."""
  from ckpt.save import pack  # pylint: disable=g-import-not-at-top
  kept, pack.MAX_LEAF_BYTES = pack.MAX_LEAF_BYTES, 0
  yield
  pack.MAX_LEAF_BYTES = kept


@pytest.fixture
def no_packing(monkeypatch):
  """arrays_only for one test (its checkpoints made in the test)."""
  from ckpt.save import pack  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(pack, "MAX_LEAF_BYTES", 0)


def record_fsync_and_rename(monkeypatch) -> list[tuple]:
  """From now on, every os.fsync (("fsync", the file's path)) and os.rename
  (("rename", src, dst)) of this process, in order, in the returned list."""
  import os  # pylint: disable=g-import-not-at-top,redefined-outer-name,reimported
  calls = []
  real_fsync, real_rename = os.fsync, os.rename

  def fsync(fd):
    calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
    return real_fsync(fd)

  def rename(src, dst, *a, **k):
    calls.append(("rename", os.fspath(src), os.fspath(dst)))
    return real_rename(src, dst, *a, **k)
  monkeypatch.setattr(os, "fsync", fsync)
  monkeypatch.setattr(os, "rename", rename)
  return calls
