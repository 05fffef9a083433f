"""Hugging Face <-> Loong tensors for DeepSeek-V3.2: DeepSeek-V3's mapping (:mod:`..deepseek_v3.mapping`) plus each
layer's lightning indexer, renamed one to one (``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`` is
``self_attention.indexer.…``; ``k_norm`` is a LayerNorm with a bias). Multi-token-prediction layers have an indexer
too (DeepSeek's release stores ``model.layers.61.self_attn.indexer.*``). Dtypes are kept (transformers keeps
``weights_proj`` in fp32; a bf16 Loong model loads it as bf16).
"""

from __future__ import annotations

from loong.core.errors import LoongError
from loong.llm.models.config import DenseModelConfig
from loong.llm.models.deepseek_v3.mapping import ONE, Rule

_INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


def indexer_rules(cfg: DenseModelConfig) -> dict[str, Rule]:
    """native suffix -> rule of one layer's indexer tensors (DeepSeek-V3's layer rules add them for V3.2)."""
    r, d, ih, idim = cfg.q_lora_rank, cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    if r is None:
        raise LoongError("family=deepseek_v32 needs q_lora_rank (the indexer reads the q latent)")
    shapes = {"wq_b.weight": (ih * idim, r), "wk.weight": (idim, d), "k_norm.weight": (idim,),
              "k_norm.bias": (idim,), "weights_proj.weight": (ih, d)}
    return {f"self_attention.indexer.{k}": (shapes[k], ONE, (f"self_attn.indexer.{k}",)) for k in _INDEXER}
