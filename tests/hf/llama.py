"""A tiny Llama-shaped model in Hugging Face's names, written with the
``safetensors`` library (as the Hub's files are), and the name rules that
place it onto a Flax-style scanned tree (``params/layers/...`` with a
leading layer axis, kernels (in, out))."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

BF16 = np.dtype(ml_dtypes.bfloat16)
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 4, 32, 4, 2, 8, 64, 48

# HF key suffix of each per-layer weight -> (flax leaf, HF shape (out, in)).
LAYER = {
    "self_attn.q_proj.weight": ("attn/q/kernel", (HEADS * HEAD_DIM, HIDDEN)),
    "self_attn.k_proj.weight": ("attn/k/kernel", (KV_HEADS * HEAD_DIM, HIDDEN)),
    "self_attn.v_proj.weight": ("attn/v/kernel", (KV_HEADS * HEAD_DIM, HIDDEN)),
    "self_attn.o_proj.weight": ("attn/o/kernel", (HIDDEN, HEADS * HEAD_DIM)),
    "mlp.gate_proj.weight": ("mlp/gate/kernel", (MLP, HIDDEN)),
    "mlp.up_proj.weight": ("mlp/up/kernel", (MLP, HIDDEN)),
    "mlp.down_proj.weight": ("mlp/down/kernel", (HIDDEN, MLP)),
}
NORMS = {"input_layernorm.weight": "attn_norm/scale",
         "post_attention_layernorm.weight": "mlp_norm/scale"}

NAMES = [
    (r"model\.embed_tokens\.weight", "params/embed/embedding"),
    (r"model\.norm\.weight", "params/norm/scale"),
    (r"lm_head\.weight", r"params/lm_head/kernel.T"),
    *[(rf"model\.layers\.(\d+)\.{k.replace('.', chr(92) + '.')}",
       rf"params/layers/{v}[\1].T") for k, (v, _) in LAYER.items()],
    *[(rf"model\.layers\.(\d+)\.{k.replace('.', chr(92) + '.')}",
       rf"params/layers/{v}[\1]") for k, v in NORMS.items()],
]


def tensors(seed: int = 0, layers: int = LAYERS) -> dict[str, np.ndarray]:
  """Every tensor of the model, in bf16, by HF key."""
  rng = np.random.default_rng(seed)

  def w(*shape):
    return rng.standard_normal(shape, np.float32).astype(BF16)
  out = {"model.embed_tokens.weight": w(VOCAB, HIDDEN),
         "model.norm.weight": w(HIDDEN), "lm_head.weight": w(VOCAB, HIDDEN)}
  for i in range(layers):
    for k, (_, shape) in LAYER.items():
      out[f"model.layers.{i}.{k}"] = w(*shape)
    for k in NORMS:
      out[f"model.layers.{i}.{k}"] = w(HIDDEN)
  return out


def write(directory, tensors_by_key: dict[str, np.ndarray], shards: int = 2,
          index: bool = True) -> list[str]:
  """``tensors_by_key`` as ``shards`` files (and the index JSON)."""
  os.makedirs(directory, exist_ok=True)
  keys = sorted(tensors_by_key)
  names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
           for i in range(shards)]
  weight_map = {}
  for i, name in enumerate(names):
    part = {k: tensors_by_key[k] for k in keys[i::shards]}
    save_file(part, os.path.join(directory, name), metadata={"format": "pt"})
    weight_map.update({k: name for k in part})
  if index:
    total = sum(v.nbytes for v in tensors_by_key.values())
    with open(os.path.join(directory, "model.safetensors.index.json"),
              "w") as f:
      json.dump({"metadata": {"total_size": total},
                 "weight_map": weight_map}, f)
  return names


def expected(tensors_by_key: dict[str, np.ndarray], layers: int = LAYERS
             ) -> dict[str, np.ndarray]:
  """The flax tree's leaves (by path) the NAMES rules make of them."""
  out = {"params/embed/embedding": tensors_by_key["model.embed_tokens.weight"],
         "params/norm/scale": tensors_by_key["model.norm.weight"],
         "params/lm_head/kernel": tensors_by_key["lm_head.weight"].T}
  for k, (v, _) in LAYER.items():
    out[f"params/layers/{v}"] = np.stack(
        [tensors_by_key[f"model.layers.{i}.{k}"].T for i in range(layers)])
  for k, v in NORMS.items():
    out[f"params/layers/{v}"] = np.stack(
        [tensors_by_key[f"model.layers.{i}.{k}"] for i in range(layers)])
  return out


def nested(flat: dict[str, object]) -> dict:
  out: dict = {}
  for path, v in flat.items():
    node = out
    *parents, last = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = v
  return out
