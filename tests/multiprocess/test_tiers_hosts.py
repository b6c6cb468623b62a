"""The local tier's partners on other hosts (issue 23 item 9), with real
processes that each run on a "host" of their own.

Each of 4 processes (2 CPU devices each) runs in its own UTS and mount
namespace (``unshare --uts --mount``): its host name is hostA (processes 0,
1) or hostB (2, 3), an /etc/hosts bound over the real one resolves that
name (gloo binds to the address of the host name), and the local tier's
directory is a bind mount of that host's own directory, at the same path
on every process. The persistent tier is shared.

A first job saves steps 1..6 (persistent: 4). Then hostB is lost (its
directory, both processes' local parts, is emptied) and a restart must
restore step 6 from the local tier, bit-exact: hostA holds the replicas of
hostB's processes. With the old ring (0->1->2->3->0) process 2's replica
was on process 3, on the lost host, and the restart fell back to the
persistent step 4. A last restart with the processes on other hosts (a
different partner map) must not use replicas saved under the old map.

Where namespaces cannot be made (not root and no user namespaces), the
tests skip, saying why; tests/tiers/test_partner.py checks the map itself always.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from ckpt.multihost import local_cluster
from tests.multiprocess import tiers_hosts_worker
from tests.multiprocess import worker

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
WORKER = "tests.multiprocess.tiers_hosts_worker"
N = 4
# $0: host name, $1: its /etc/hosts, $2: its local directory, $3: where it
# is bound; then the command.
_SETUP = ('hostname "$0" && mount --bind "$1" /etc/hosts && '
          'mount --bind "$2" "$3" && shift 3 && exec "$@"')


# Root needs no user namespace; others (and a root without CAP_SYS_ADMIN)
# may have one. The probe keeps the first that works.
_UNSHARE = (["unshare", "--uts", "--mount"],
            ["unshare", "--user", "--map-root-user", "--uts", "--mount"])
_unshare: list[str] = []


def _hosts_file(root: pathlib.Path, host: str) -> str:
  path = root / f"etc_hosts_{host}"
  if not path.exists():
    try:
      real = pathlib.Path("/etc/hosts").read_text()
    except OSError:
      real = "127.0.0.1 localhost\n"
    path.write_text(real.rstrip("\n") + f"\n127.0.0.1 {host}\n")
  return str(path)


def _prefix(root: pathlib.Path, hosts: list[str], dirs: list[str]):
  """Process p runs on host ``hosts[p]`` and sees ``root/dirs[p]`` at
  ``root/local``."""
  (root / "local").mkdir(exist_ok=True)

  def prefix(pid: int) -> list[str]:
    (root / dirs[pid]).mkdir(exist_ok=True)
    return [*_unshare, "sh", "-c", _SETUP, hosts[pid],
            _hosts_file(root, hosts[pid]), str(root / dirs[pid]),
            str(root / "local")]
  return prefix


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  """Skips, naming the cause, unless a process can get its own host name,
  resolve it and see a directory bound in its own mount namespace."""
  root = tmp_path_factory.mktemp("tierhosts")
  if shutil.which("unshare") is None:
    pytest.skip("no `unshare` here: processes cannot get host names of their "
                "own (util-linux)")
  probe = ("import os, socket, sys; assert socket.gethostname() == 'hostProbe';"
           " socket.getaddrinfo('hostProbe', None);"
           " assert os.listdir(sys.argv[1]) == ['seen']")
  (root / "probe_dir").mkdir()
  (root / "probe_dir" / "seen").touch()
  (root / "probe_mnt").mkdir()
  failed = []
  for base in _UNSHARE:
    _unshare[:] = base
    cmd = _prefix(root, ["hostProbe"], ["probe_dir"])(0)
    cmd[-1] = str(root / "probe_mnt")
    try:
      r = subprocess.run([*cmd, sys.executable, "-c", probe,
                          str(root / "probe_mnt")], capture_output=True,
                         text=True, timeout=60)
      out = f"exited {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}"
    except subprocess.TimeoutExpired:
      r, out = None, "did not finish in 60 s"
    if r is not None and r.returncode == 0:
      break
    failed.append(f"`{' '.join(base)} ...` {out}")
  else:
    pytest.skip(f"cannot give a process its own host name and mounts here "
                f"(uid {os.geteuid()}): " + "; ".join(failed))
  return root


def _run(root, scenario, hosts, dirs, **extra):
  conf = {"persistent": str(root / "persistent"), "local": str(root / "local"),
          "scenario": scenario, **extra}
  return [worker.decode(tiers_hosts_worker.Result, r)
          for r in local_cluster.check(local_cluster.run(
              WORKER, conf, num_processes=N, devices_per_process=2,
              timeout_s=180, cwd=REPO_ROOT, prefix=_prefix(root, hosts,
                                                           dirs)))]


AABB = ["hostA", "hostA", "hostB", "hostB"]


@pytest.fixture(scope="module")
def lost_host(root):
  """Saves 1..6, empties hostB's directory, restarts (and saves step 7)."""
  saved = _run(root, "save", AABB, AABB, steps=6)
  lost = sorted(os.listdir(root / "hostB"))
  shutil.rmtree(root / "hostB")
  restored = _run(root, "restore", AABB, AABB, save_after=True)
  return saved, lost, restored


def test_each_process_keeps_the_replica_of_a_process_on_another_host(
    root, lost_host):
  saved, lost, _ = lost_host
  for p, r in enumerate(saved):
    assert r.host == AABB[p], r  # the namespaces are real
    assert r.dst == [2, 3, 0, 1], r
    assert r.hosts == AABB, r
    assert r.local_steps == [5, 6], r
  assert lost == ["process_2", "process_3"], lost
  assert sorted(os.listdir(root / "hostA")) == ["process_0", "process_1"]


def test_losing_a_whole_host_restores_the_newest_local_step(lost_host):
  _, _, restored = lost_host
  for p, r in enumerate(restored):
    assert r.entries == (["step_5", "step_6"] if p < 2 else None), r
    got = r.restored
    assert (got.tier, got.step, got.exact) == ("local", 6, True), r
    assert got.from_partner == (p >= 2), r
    assert got.host_state == {"pos": 600 + p}, r
    assert "[2, 3]" in got.reason, r   # who came back from their partners
    assert r.local_steps == ([6, 7] if p < 2 else [7]), r


def test_a_replica_saved_under_another_partner_map_is_not_used(root,
                                                               lost_host):
  """The processes restart on other hosts (0, 2 on hostA; 1, 3 on hostB:
  partners 0<->1, 2<->3) with the same directories; process 2 lost its own
  part. Process 3 holds process 1's replica (saved under the old map), not
  process 2's: the local tier cannot rebuild step 7, and says why."""
  del lost_host  # step 7 saved
  shutil.rmtree(root / "hostB" / "process_2")
  got = _run(root, "restore", ["hostA", "hostB", "hostA", "hostB"], AABB)
  for p, r in enumerate(got):
    assert r.dst == [1, 0, 3, 2], r
    got = r.restored
    assert (got.tier, got.step, got.exact) == ("persistent", 4, True), r
    assert "partner map" in got.reason, r
    assert "holds the replica of process 1" in got.reason, r
