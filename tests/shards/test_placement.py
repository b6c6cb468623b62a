"""ckpt/shards/placement.py: each process's boxes computed from the mesh alone
agree with jax's own devices_indices_map, for every process of a job."""

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ckpt.shards import placement
from ckpt.shards import plan
from ckpt.save import leaves as leaves_lib

MESHES = [
    ((8,), ("x",)),
    ((4, 2), ("data", "model")),
    ((2, 4), ("data", "model")),
    ((2, 2, 2), ("a", "b", "c")),
]


def _specs(names):
  """Every spec using each mesh axis at most once over two dims."""
  out = [()]
  options = [None, *names, *itertools.permutations(names, 2)]
  for first in options:
    for second in options:
      used = [a for e in (first, second) if e is not None
              for a in ((e,) if isinstance(e, str) else e)]
      if len(used) == len(set(used)):
        out.append((first, second))
  return out


def _reference(mesh, spec, shape, devices_per_process, process):
  """The Placement from jax's global devices_indices_map."""
  sharding = NamedSharding(mesh, P(*spec))
  index_map = {d.id: idx for d, idx in
               sharding.devices_indices_map(shape).items()}
  process_of = {d.id: d.id // devices_per_process for d in mesh.devices.flat}
  shards = plan.shards_from_index_map(shape, index_map, process_of)
  return plan.placement_from_shards(shape, shards, process)


@pytest.mark.parametrize("mesh_shape,names", MESHES)
@pytest.mark.parametrize("devices_per_process", [1, 2, 4])
def test_named_matches_devices_indices_map(mesh_shape, names,
                                           devices_per_process):
  # A shuffled device order, so mesh position and device id differ.
  devices = np.array(jax.devices())[np.random.default_rng(0).permutation(8)]
  mesh = Mesh(devices.reshape(mesh_shape), names)
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  shape = (16, 24)
  checked = 0
  for spec in _specs(names):
    axes = placement.spec_axes(spec, 2)
    for p in range(8 // devices_per_process):
      info = placement.make_mesh_info(names, ids, ids // devices_per_process, p)
      got = info.named(axes, shape)
      want = _reference(mesh, spec, shape, devices_per_process, p)
      assert got.unit == want.unit, spec
      assert got.split_elems == want.split_elems, spec
      assert [(s.box, s.holders) for s in got.local] == [
          (s.box, s.holders) for s in want.local], (spec, p)
      for s in got.local:  # read from one of this process's devices
        assert s.device // devices_per_process == p
      checked += 1
  assert checked == len(_specs(names)) * (8 // devices_per_process)


def test_uneven_shape_and_odd_specs_take_the_generic_path():
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
  info = placement.mesh_info(mesh, 0)
  assert info.named(placement.spec_axes(("data",), 1), (6,)) is None
  assert placement.spec_axes((P.UNCONSTRAINED,), 1) is None
  assert placement.spec_axes(("data", None, None), 2) is None


def test_plan_save_plans_only_this_process_and_matches_the_global_plan():
  """Simulated: the same state planned as each process of a 4-process job
  covers every element once; planned as process 0 it holds only process
  0's writes (single-process jax, so the mesh's process map is synthetic)."""
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  specs = {"w": ("data", "model"), "emb": ("model", None), "norm": (),
           "qkv": (None, ("model", "data"))}
  shapes = {"w": (64, 32), "emb": (128, 16), "norm": (1024,),
            "qkv": (16, 64)}
  n = 4
  writes = []
  for p in range(n):
    info = placement.make_mesh_info(("data", "model"), ids, ids // 2, p)
    for name in specs:
      pl = info.named(placement.spec_axes(specs[name], len(shapes[name])),
                      shapes[name])
      lay = plan.leaf_layout(shapes[name], 4, pl, 1024)
      writes += [(name, w) for w in plan.assign_writes([lay], p)]
  for name, shape in shapes.items():
    count = np.zeros(shape, np.int32)
    for nm, w in writes:
      if nm == name:
        count[w.box.slices()] += 1
    assert (count == 1).all(), name
  per = np.bincount([w.process for _, w in writes],
                    weights=[w.nbytes for _, w in writes], minlength=n)
  assert per.max() <= 1.5 * per.sum() / n, per


def test_plan_save_holds_only_local_writes(tmp_path):
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
  x = jax.device_put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
                     NamedSharding(mesh, P("data")))
  sp = leaves_lib.plan_save({"x": x, "h": np.ones((300, 300), np.float32)},
                            leaves_lib.SaveOptions())
  assert {w.process for w in sp.writes} == {0}
  assert sum(w.nbytes for w in sp.writes) == x.nbytes + 300 * 300 * 4
  # Two devices hold each row block; each block is written once.
  assert sorted(w.box.start for w in sp.writes if w.leaf == 1) == [
      (16 * i, 0) for i in range(4)]


def test_single_device_and_other_shardings():
  d = jax.devices()[3]
  x = jax.device_put(np.ones((4, 4), np.float32), d)
  pl = placement.placement(x.sharding, x.shape, 0)
  assert [(s.box, s.device, s.holders) for s in pl.local] == [
      (plan.Box((0, 0), (4, 4)), 3, (0,))]
  assert placement.placement(x.sharding, x.shape, 1).local == ()
  # A GSPMD-style sharding without a mesh goes through devices_indices_map.
  pos = jax.sharding.PositionalSharding(jax.devices()).reshape(8, 1) \
      if hasattr(jax.sharding, "PositionalSharding") else None
  if pos is not None:
    pl = placement.placement(pos, (16, 4), 0)
    assert len(pl.local) == 8
