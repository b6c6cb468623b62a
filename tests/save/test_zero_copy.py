"""Async save without a staging copy on CPU devices (issue #16).

save() returns once every owned box is staged; from a CPU device a staged
box is a view of the device buffer, not a copy. These tests hold the writes
back until the caller has done each thing a training loop can do to its
arrays after save() returns (delete, donate to a jitted step, drop the
last reference, clear jax's caches), then check what was written is what
was passed in. Host numpy leaves are mutable and must still be copied.
"""

import asyncio
import gc
import threading
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ckpt
from ckpt.save import staging
from ckpt.save import write as save_lib
from tests.conftest import mesh, named, random_array, sharded

MiB = 1 << 20


@pytest.fixture
def held_writes(monkeypatch):
  """A gate: the save's writes wait until ``gate.set()`` (staging and the
  caller's release do not); opened on teardown so nothing hangs."""
  gate = threading.Event()
  plain = save_lib._open_arrays  # pylint: disable=protected-access

  async def gated(*args, **kwargs):
    await asyncio.to_thread(gate.wait, 60)
    return await plain(*args, **kwargs)

  monkeypatch.setattr(save_lib, "_open_arrays", gated)
  yield gate
  gate.set()


def _state(rng, m):
  return {
      "w": sharded(random_array(rng, (256, 128)), named(m, "data", "model")),
      "rep": sharded(random_array(rng, (64, 32)), named(m)),
      "col": sharded(random_array(rng, (32, 64)), named(m, None, "model")),
      "host": random_array(rng, (40, 10)),
  }


def _expected(state):
  return jax.tree.map(lambda x: np.array(x, copy=True), state)


def _donating_step(state):
  fn = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 7, s),
               donate_argnums=0)
  return fn(state)


@pytest.mark.parametrize("what", ["delete", "donate", "drop", "clear_caches"])
def test_async_save_is_safe_after_the_caller_lets_go(what, rng, make_ckptr,
                                                     ckpt_dir, held_writes):
  m = mesh()
  ckptr = make_ckptr(async_save=True)
  state = _state(rng, m)
  want = _expected(state)
  ckptr.save(1, state)
  assert not ckptr.last_save_stats.total_s  # the writes are still held
  devices_state = {k: v for k, v in state.items() if k != "host"}
  if what == "delete":
    for x in devices_state.values():
      x.delete()
  elif what == "donate":  # a training step: the name now holds its output
    for _ in range(3):
      devices_state = _donating_step(devices_state)
    jax.block_until_ready(devices_state)
    np.testing.assert_array_equal(np.asarray(devices_state["w"]),
                                  np.full((256, 128), -7, np.float32))
  elif what == "clear_caches":
    jax.clear_caches()
  state["host"][:] = -1  # a host leaf changed after save() returned
  del state, devices_state
  gc.collect()
  held_writes.set()
  ckptr.wait_until_finished()
  got = ckpt.load(ckpt_dir, 1)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _staging_peak(ckptr, state) -> int:
  """Peak bytes numpy allocated while save() ran, over what was allocated
  before (numpy reports its allocations to tracemalloc). Tracing must
  already be on (``tracing``): stopping it while the save's writes still
  run on other threads crashed the process twice in full runs (CPython
  3.11's tracemalloc.stop() races frees reported from other threads)."""
  base = tracemalloc.get_traced_memory()[0]
  tracemalloc.reset_peak()
  ckptr.save(1, state)
  return tracemalloc.get_traced_memory()[1] - base


@pytest.fixture
def tracing():
  """tracemalloc on for the test; stopped after it, once its
  Checkpointers (closed first: fixtures end in reverse order) are idle."""
  tracemalloc.start()
  yield
  tracemalloc.stop()


def test_async_save_copies_no_cpu_device_buffer(tracing, rng, tmp_path,
                                                make_ckptr, held_writes):
  """Staging 80 MiB of CPU device data allocates no host copy of it; a
  cast and a host numpy leaf still do (the test can tell a copy)."""
  m = mesh()
  state = {
      "big": sharded(random_array(rng, (4096, 4096)), named(m, "data", "model")),
      "rep": sharded(random_array(rng, (1024, 1024)), named(m)),
  }
  ckptr = make_ckptr(tmp_path / "plain", async_save=True,
                     concurrent_bytes=256 * MiB)
  peak = _staging_peak(ckptr, state)
  held_writes.set()
  ckptr.wait_until_finished()
  assert peak < 8 * MiB, f"staging allocated {peak / MiB:.1f} MiB"
  got = ckpt.load(tmp_path / "plain", 1)
  np.testing.assert_array_equal(got["big"], np.asarray(state["big"]))

  host = {"h": random_array(rng, (2048, 2048))}  # 16 MiB, mutable
  cast = make_ckptr(tmp_path / "cast", async_save=True,
                    save_dtype=jnp.bfloat16, concurrent_bytes=256 * MiB)
  copied = make_ckptr(tmp_path / "host", async_save=True,
                      concurrent_bytes=256 * MiB)
  assert _staging_peak(cast, {"big": state["big"]}) >= 32 * MiB  # bf16 copy
  cast.wait_until_finished()  # its copy freed: not in the next one's base
  assert _staging_peak(copied, host) >= 16 * MiB
  copied.wait_until_finished()


def test_copies_to_the_host_start_together_within_the_budget(
    rng, tmp_path, make_ckptr, monkeypatch):
  """Every box that fits in the budget has its device-to-host copy started
  before the first one is waited for (transfers of all local devices
  overlap); started and not yet landed never exceeds the budget."""
  events = []
  plain_start = staging.device_piece
  plain_land = staging._host_box  # pylint: disable=protected-access

  def start(leaf, write):
    events.append(("start", write.nbytes))
    return plain_start(leaf, write)

  def land(leaf, write, piece, borrow=False):
    events.append(("land", write.nbytes))
    return plain_land(leaf, write, piece, borrow)

  monkeypatch.setattr(staging, "device_piece", start)
  monkeypatch.setattr(staging, "_host_box", land)
  m = mesh()
  # 8 devices x 2 leaves: 16 boxes of 1 MiB; a 4 MiB budget.
  state = {f"w{i}": sharded(random_array(rng, (2048, 1024)),
                            named(m, "data", "model")) for i in range(2)}
  ckptr = make_ckptr(tmp_path / "c", async_save=True,
                     concurrent_bytes=4 * MiB, chunk_bytes=1 * MiB)
  ckptr.save(1, state)
  ckptr.wait_until_finished()
  first_land = next(i for i, (e, _) in enumerate(events) if e == "land")
  assert first_land == 4, events[:8]  # 4 copies in flight at once
  assert [e for e, _ in events].count("start") == 16
  in_flight = peak = 0
  for e, n in events:
    in_flight += n if e == "start" else -n
    peak = max(peak, in_flight)
  assert peak <= 4 * MiB
  got = ckpt.load(tmp_path / "c", 1)
  for k, v in state.items():
    np.testing.assert_array_equal(got[k], np.asarray(v))


@pytest.mark.parametrize("pinned", [True, False])
def test_boxes_cut_on_the_device_as_on_an_accelerator(rng, tmp_path,
                                                      make_ckptr, monkeypatch,
                                                      pinned):
  """The accelerator path (each chunk of a shard sliced on the device, then
  copied to the host: into pinned host memory, or with
  ``copy_to_host_async``) saves the same bytes; forced here on CPU devices
  (which have pinned host memory too), with shards cut into chunks by a
  small budget and spread over replicas. The caller deletes its arrays as
  soon as save() returns: the staged copies are ckpt's own."""
  cuts, kinds = [], []

  def cut(device):
    cuts.append(device.id)
    return True

  plain_copy = staging.start_host_copy

  def copy(piece):
    out = plain_copy(piece)
    kinds.append(out.sharding.memory_kind)
    return out

  monkeypatch.setattr(staging, "cut_on_device", cut)
  monkeypatch.setattr(staging, "start_host_copy", copy)
  monkeypatch.setattr(staging, "PINNED_STAGING", pinned)
  m = mesh()
  state = {"w": sharded(random_array(rng, (512, 256)), named(m, "data")),
           "rep": sharded(random_array(rng, (256, 64)), named(m)),
           "b": sharded(random_array(rng, (64, 512), jnp.bfloat16),
                        named(m, None, "model"))}
  ckptr = make_ckptr(tmp_path / "c", async_save=True,
                     concurrent_bytes=64 << 10, chunk_bytes=32 << 10)
  expected = {k: np.array(v) for k, v in state.items()}
  ckptr.save(1, state)
  for v in state.values():
    v.delete()
  ckptr.wait_until_finished()
  assert len(cuts) > 8  # boxes smaller than their shards were cut
  assert kinds and set(kinds) == {"pinned_host" if pinned else "device"}
  got = ckpt.load(tmp_path / "c", 1)
  for k, v in expected.items():
    np.testing.assert_array_equal(got[k], v, err_msg=k)
