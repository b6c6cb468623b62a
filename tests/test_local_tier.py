"""Unit tests of the local tier (ckpt/local_tier.py, ckpt/partner.py) that
need no multi-process job."""

import pytest

import ckpt
from ckpt import partner


def test_partner_is_another_process_and_another_slice():
  assert partner.partner_of(1, [0]) == [0]
  assert partner.partner_of(4, [0] * 4) == [1, 2, 3, 0]
  dst = partner.partner_of(4, [0, 0, 1, 1])
  assert dst == [2, 3, 0, 1]
  assert all(p != q for p, q in enumerate(partner.partner_of(5, [0] * 5)))


def test_local_keep_must_be_two_or_more(tmp_path):
  with pytest.raises(ValueError, match="local_keep"):
    ckpt.MultiTierCheckpointer(str(tmp_path / "p"), local=str(tmp_path / "l"),
                               local_keep=1)
