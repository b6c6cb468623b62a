"""The local tier's partner map (ckpt/tiers/partner.py ``partner_of``): pure, no
processes. The real-process check is tests/multiprocess/test_tiers_hosts.py."""

import itertools
import random

from ckpt.tiers import partner


def _check(dst, hosts):
  n = len(hosts)
  assert sorted(dst) == list(range(n)), (hosts, dst)  # one replica each
  if n > 1:
    assert all(dst[p] != p for p in range(n)), (hosts, dst)
  m = max(hosts.count(h) for h in set(hosts))
  same = sum(hosts[p] == hosts[dst[p]] for p in range(n))
  if len(set(hosts)) == 1:
    assert dst == [(p + 1) % n for p in range(n)], (hosts, dst)
  else:  # the fewest replicas on their own host that any permutation allows
    assert same == max(0, 2 * m - n), (hosts, dst, same)


def test_two_hosts_of_two_processes_send_across():
  assert partner.partner_of(4, [0] * 4, ["A", "A", "B", "B"]) == [2, 3, 0, 1]
  assert partner.partner_of(4, [0] * 4, ["A", "B", "A", "B"]) == [1, 0, 3, 2]
  # Four processes per host (one per GPU): the old ring kept 6 of 8 replicas
  # on their own host; now none.
  hosts = ["A"] * 4 + ["B"] * 4
  assert partner.partner_of(8, [0] * 8, hosts) == [4, 5, 6, 7, 0, 1, 2, 3]


def test_one_host_or_unknown_hosts_is_the_ring():
  assert partner.partner_of(1, [0], ["A"]) == [0]
  assert partner.partner_of(4, [0] * 4, ["A"] * 4) == [1, 2, 3, 0]
  assert partner.partner_of(4, [0] * 4) == [1, 2, 3, 0]


def test_unequal_hosts_keep_as_few_replicas_at_home_as_possible():
  # A has 3, B has 1: two replicas must stay on A (B holds one only).
  dst = partner.partner_of(4, [0] * 4, ["A", "A", "A", "B"])
  assert dst == [3, 0, 1, 2]
  _check(dst, ["A", "A", "A", "B"])
  # 3 + 2 + 1: every replica on another host.
  hosts = ["A", "A", "A", "B", "B", "C"]
  _check(partner.partner_of(6, [0] * 6, hosts), hosts)


def test_every_assignment_gives_a_permutation_with_the_fewest_at_home():
  rng = random.Random(23)
  for n in range(1, 9):
    for hosts in itertools.product("ABC", repeat=n):
      _check(partner.partner_of(n, [0] * n, list(hosts)), list(hosts))
  for _ in range(200):
    n = rng.randrange(2, 40)
    hosts = [f"h{rng.randrange(rng.randrange(1, 8))}" for _ in range(n)]
    _check(partner.partner_of(n, [0] * n, hosts), hosts)


def test_the_map_depends_on_who_shares_a_host_not_on_host_names():
  """A replaced host comes back under a new name: the map (and so every
  replica on disk) stays valid."""
  for hosts in (["A", "A", "B", "B", "C", "C"], ["A", "B", "C", "A", "B"],
                ["A", "A", "A", "B", "C", "C"]):
    renamed = [{"A": "zz", "B": "aa", "C": "mm"}[h] for h in hosts]
    assert (partner.partner_of(len(hosts), [0] * len(hosts), hosts) ==
            partner.partner_of(len(hosts), [0] * len(hosts), renamed))


def test_equal_slices_keep_the_next_slice_at_the_same_position():
  # Two slices of two hosts each: slices decide (a slice is several hosts).
  hosts = ["A", "A", "B", "B", "C", "C", "D", "D"]
  dst = partner.partner_of(8, [0, 0, 0, 0, 1, 1, 1, 1], hosts)
  assert dst == [4, 5, 6, 7, 0, 1, 2, 3]
  assert partner.partner_of(4, [0, 0, 1, 1]) == [2, 3, 0, 1]
  # Unequal slices: by host.
  hosts = ["A", "A", "B", "C"]
  _check(partner.partner_of(4, [0, 0, 0, 1], hosts), hosts)


def test_host_id_can_be_overridden(monkeypatch):
  monkeypatch.setenv(partner.ENV_HOST_ID, "node-7")
  assert partner.host_id() == "node-7"
  monkeypatch.delenv(partner.ENV_HOST_ID)
  import socket  # pylint: disable=g-import-not-at-top
  assert partner.host_id() == socket.gethostname()


def test_replicas_kept_on_their_own_host_are_logged(caplog):
  import logging  # pylint: disable=g-import-not-at-top
  hosts = ["A", "A", "A", "B"]
  with caplog.at_level(logging.INFO, logger="absl"):
    partner._log_map(partner.partner_of(4, [0] * 4, hosts), hosts)  # pylint: disable=protected-access
  text = caplog.text
  assert "0->3, 1->0, 2->1, 3->2" in text, text
  assert "2 process(es) on their own host" in text, text
  assert "process 1 -> 0 on 'A', process 2 -> 1 on 'A'" in text, text
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="absl"):
    partner._log_map([1, 2, 0], ["A"] * 3)  # pylint: disable=protected-access
  assert "all report host 'A'" in caplog.text, caplog.text
