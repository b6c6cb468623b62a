"""Name rules forward and reversed (ckpt/hf/names.py), without files."""

from __future__ import annotations

import pytest

from ckpt.hf import names as names_lib


def test_places_parse_index_and_transpose():
  p = names_lib.parse_place("params/layers/up/kernel[12].T", "k")
  assert p == names_lib.Place("params/layers/up/kernel", 12, True)
  assert p.text() == "params/layers/up/kernel[12].T"
  assert names_lib.parse_place("a/b", "k") == names_lib.Place("a/b")
  with pytest.raises(names_lib.TreeMismatchError, match="expected a target"):
    names_lib.parse_place(3, "k")


@pytest.mark.parametrize("rule,key,text", [
    ((r"^model\.layers\.(\d+)\.mlp\.(up|gate)_proj\.weight$",
      r"p/layers/mlp/\2/kernel[\1].T"),
     "model.layers.7.mlp.gate_proj.weight", "p/layers/mlp/gate/kernel[7].T"),
    ((r"model\.layers\.(?P<i>\d+)\.(?P<w>q|k|v)\.weight",
      r"p/\g<w>/kernel[\g<i>]"), "model.layers.3.k.weight", "p/k/kernel[3]"),
    ((r"blocks\.(\d+(?:_\d+)?)\.w", r"b/\1"), "blocks.2_1.w", "b/2_1"),
])
def test_regex_rules_reverse(rule, key, text):
  n = names_lib.Names([rule])
  assert n.forward(key) == text
  assert n.key_of(text) == key
  assert n.key_of(text + "x") is None


def test_a_group_used_twice_must_agree():
  n = names_lib.Names([(r"w(\d+)", r"a[\1]/b\1")])
  assert n.key_of("a[3]/b3") == "w3"
  assert n.key_of("a[3]/b4") is None


def test_the_first_rule_that_maps_back_wins_and_is_checked_forward():
  # The second rule reverses "x[1]k" to "k1", whose forward rule is the
  # first one's: the key found must map back to the same path.
  n = names_lib.Names([(r"k(\d+)", r"y[\1]"), (r"(k)(\d+)", r"x[\2]\1")])
  assert n.forward("k1") == "y[1]"
  assert n.key_of("y[1]") == "k1"
  assert n.key_of("x[1]k") is None


@pytest.mark.parametrize("rule,match", [
    ((r"a.b", "x"), r"'\.' outside a group"),
    ((r"a(?:b)(c)", r"\1"), "a group that captures nothing"),
    ((r"a(b(c))", r"x\1\2"), "a capture group inside a group"),
    ((r"a(b)", r"x\n"), "an escape"),
    ((r"a(b", "x"), None),
])
def test_rules_export_cannot_reverse(rule, match):
  if match is None:
    with pytest.raises(TypeError, match="not a regex"):
      names_lib.Names([rule])
    return
  with pytest.raises(names_lib.NotReversible, match=match):
    names_lib.Names([rule]).key_of("x")


def test_bad_names_arguments():
  with pytest.raises(TypeError, match="names must be"):
    names_lib.Names(3)
  with pytest.raises(TypeError, match="pair"):
    names_lib.Names([("a",)])
  assert names_lib.Names({"a": None}).forward("a") is None
  assert names_lib.Names({"a": "b"}).forward("c") is names_lib.UNMATCHED
