"""Hugging Face <-> Loong tensors for DeepSeek-V3.2: DeepSeek-V3's mapping (:mod:`..deepseek_v3.mapping`) plus each
layer's lightning indexer, renamed one to one (``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`` is
``self_attention.indexer.…``; ``k_norm`` is a LayerNorm with a bias). Multi-token-prediction layers have an indexer
too (DeepSeek's release stores ``model.layers.61.self_attn.indexer.*``). Dtypes are kept (transformers keeps
``weights_proj`` in fp32; a bf16 Loong model loads it as bf16).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from loong.core.errors import LoongError
from loong.llm.models.config import DenseModelConfig
from loong.llm.models.deepseek_v3 import mapping as v3

Tensor = torch.Tensor

_INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


def _as_v3(cfg: DenseModelConfig) -> DenseModelConfig:
    return dataclasses.replace(cfg, family="deepseek_v3")


def _indexer_pairs(cfg: DenseModelConfig) -> list[tuple[str, str]]:
    """(native key, HF key) of every indexer tensor (decoder layers and MTP modules)."""
    return [(f"{native}self_attention.indexer.{k}", f"{hf}self_attn.indexer.{k}")
            for native, hf, _ in v3._layers(cfg) for k in _INDEXER]


def native_shapes(cfg: DenseModelConfig) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3's shapes plus the indexers'."""
    r, d, ih, idim = cfg.q_lora_rank, cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    if r is None:
        raise LoongError("family=deepseek_v32 needs q_lora_rank (the indexer reads the q latent)")
    own = {"wq_b.weight": (ih * idim, r), "wk.weight": (idim, d), "k_norm.weight": (idim,), "k_norm.bias": (idim,),
           "weights_proj.weight": (ih, d)}
    shapes = v3.native_shapes(_as_v3(cfg))
    for native, _ in _indexer_pairs(cfg):
        shapes[native] = own[native.rsplit("indexer.", 1)[1]]
    return shapes


def hf_to_native(hf_state: Mapping[str, Tensor], cfg: DenseModelConfig) -> dict[str, Tensor]:
    """HF tensors -> Loong's per-layer native tensors (V3's, then the indexers'), shapes checked."""
    rest = dict(hf_state)
    own = {}
    for native, hf in _indexer_pairs(cfg):
        if hf not in rest:
            raise LoongError(f"Hugging Face checkpoint has no tensor {hf}")
        own[native] = rest.pop(hf)
    out = v3.hf_to_native(rest, _as_v3(cfg))
    shapes = native_shapes(cfg)
    for key, t in own.items():
        if tuple(t.shape) != shapes[key]:
            raise LoongError(f"Hugging Face checkpoint: {key} has shape {tuple(t.shape)}, the config implies "
                             f"{shapes[key]}")
    return {**out, **own}


def native_to_hf(native: Mapping[str, Tensor], cfg: DenseModelConfig) -> dict[str, Tensor]:
    """Inverse of :func:`hf_to_native`."""
    shapes = native_shapes(cfg)
    pairs = _indexer_pairs(cfg)
    for key, _ in pairs:
        if key not in native:
            raise LoongError(f"Loong checkpoint: missing {key}")
        if tuple(native[key].shape) != shapes[key]:
            raise LoongError(f"Loong checkpoint: {key} has shape {tuple(native[key].shape)}, the config implies "
                             f"{shapes[key]}")
    own = {k for k, _ in pairs}
    out = v3.native_to_hf({k: t for k, t in native.items() if k not in own}, _as_v3(cfg))
    out.update({hf: native[key] for key, hf in pairs})
    return out
