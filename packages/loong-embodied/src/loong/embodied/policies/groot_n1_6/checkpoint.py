"""GR00T N1.6 checkpoint folders in the published (``nvidia/GR00T-N1.6-3B``) layout: name mapping, read, write.

The mapping is declared once, in :data:`PREFIXES`: Loong's ``state_dict`` names (left) and the published
safetensors keys (right) differ only in where the transformers modules sit inside Isaac-GR00T's wrappers
(``Gr00tN1d6.backbone`` = ``EagleBackbone``, whose ``.model`` is ``Eagle3_VLForConditionalGeneration`` holding
``vision_model`` (a ``Siglip2VisionModel`` with an inner ``.vision_model``), ``mlp1`` and ``language_model``
(a ``Qwen3ForCausalLM`` with an inner ``.model``)). The action head is named as published already.

Published keys Loong does not build (:data:`UNUSED_PUBLISHED_PREFIXES`): the Qwen3 ``lm_head`` and the SigLIP2
pooling ``head`` (GR00T never runs either; the published folder's 6.57 GB = 3.2866e9 bf16 parameters counts
both). They are skipped on load and not written on save. The LM layers above ``select_layer`` are absent from
the published files (GR00T pops them before saving), so a checkpoint with more layers is an error.

A folder is ``config.json`` (Isaac-GR00T's ``Gr00tN1d6`` config fields, plus a ``loong`` block with the full
:class:`~.config.GrootN16Config`) and ``model.safetensors`` or shards with ``model.safetensors.index.json``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from loong.core.errors import LoongError
from loong.embodied.policies.groot_n1_6.config import GrootN16Config

#: (Loong prefix, published prefix), in the order they are tried
PREFIXES: tuple[tuple[str, str], ...] = (
    ("backbone.vision_model.", "backbone.model.vision_model.vision_model."),
    ("backbone.mlp1.", "backbone.model.mlp1."),
    ("backbone.language_model.", "backbone.model.language_model.model."),
    ("action_head.", "action_head."),
)
#: published weights with no Loong counterpart (unused by GR00T)
UNUSED_PUBLISHED_PREFIXES: tuple[str, ...] = (
    "backbone.model.language_model.lm_head.",
    "backbone.model.vision_model.vision_model.head.",
)
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


def to_published_name(name: str) -> str:
    """The published key of Loong parameter ``name``."""
    for ours, theirs in PREFIXES:
        if name.startswith(ours):
            return theirs + name[len(ours):]
    raise LoongError(f"groot_n1_6 checkpoint: no published name for Loong parameter {name!r} (known prefixes: "
                     f"{', '.join(p for p, _ in PREFIXES)})")


def from_published_name(key: str) -> str | None:
    """The Loong name of published key ``key``; None for a known-unused weight."""
    if key.startswith(UNUSED_PUBLISHED_PREFIXES):
        return None
    for ours, theirs in PREFIXES:
        if key.startswith(theirs):
            return ours + key[len(theirs):]
    raise LoongError(f"groot_n1_6 checkpoint: unknown published key {key!r} (known prefixes: "
                     f"{', '.join(t for _, t in PREFIXES)})")


def to_published(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Loong ``state_dict`` under the published names."""
    return {to_published_name(name): tensor for name, tensor in state_dict.items()}


def from_published(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``(loong_state_dict, skipped_keys)`` of a published state dict (skipped: the unused weights)."""
    ours: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for key, tensor in state_dict.items():
        name = from_published_name(key)
        if name is None:
            skipped.append(key)
        else:
            ours[name] = tensor
    return ours, skipped


# --- config.json ------------------------------------------------------------------------------------------------
#: Loong field -> Isaac-GR00T ``Gr00tN1d6Config`` field (top level)
_GROOT_FIELDS = {
    "chunk_size": "action_horizon", "max_state_dim": "max_state_dim", "max_action_dim": "max_action_dim",
    "num_inference_steps": "num_inference_timesteps", "hidden_size": "hidden_size",
    "input_embedding_dim": "input_embedding_dim", "num_embodiments": "max_num_embodiments",
    "add_pos_embed": "add_pos_embed", "max_seq_len": "max_seq_len", "use_vlln": "use_vlln",
    "state_dropout_prob": "state_dropout_prob", "attend_text_every_n_blocks": "attend_text_every_n_blocks",
    "noise_beta_alpha": "noise_beta_alpha", "noise_beta_beta": "noise_beta_beta", "noise_s": "noise_s",
    "num_timestep_buckets": "num_timestep_buckets", "select_layer": "select_layer", "tune_llm": "tune_llm",
    "tune_visual": "tune_visual", "tune_top_llm_layers": "tune_top_llm_layers", "tune_projector": "tune_projector",
    "tune_diffusion_model": "tune_diffusion_model", "tune_vlln": "tune_vlln",
    "formalize_language": "formalize_language",
}
#: Loong field -> key of ``diffusion_model_cfg``
_DIT_FIELDS = {"dit_num_layers": "num_layers", "dit_num_heads": "num_attention_heads",
               "dit_head_dim": "attention_head_dim", "dit_dropout": "dropout"}


def published_config(config: GrootN16Config) -> dict[str, Any]:
    """``config.json`` contents: the ``Gr00tN1d6`` fields Isaac-GR00T reads, then the full Loong config."""
    out: dict[str, Any] = {"architectures": ["Gr00tN1d6"], "model_type": "Gr00tN1d6",
                           "model_name": "nvidia/Eagle-Block2A-2B-v2", "backbone_model_type": "eagle",
                           "backbone_embedding_dim": config.backbone_embedding_dim, "use_alternate_vl_dit": True}
    out.update({theirs: getattr(config, ours) for ours, theirs in _GROOT_FIELDS.items()})
    out["diffusion_model_cfg"] = {"positional_embeddings": None, "norm_type": "ada_norm", "final_dropout": True,
                                  "output_dim": config.hidden_size, "interleave_self_attention": True,
                                  **{theirs: getattr(config, ours) for ours, theirs in _DIT_FIELDS.items()}}
    out["loong"] = {"policy": "groot_n1_6", "config": dataclasses.asdict(config)}
    return out


def config_from_published(data: Mapping[str, Any], base: GrootN16Config | None = None) -> GrootN16Config:
    """The Loong config of a ``config.json``: its ``loong`` block when present, else ``base`` (default: the
    published shape) updated by the ``Gr00tN1d6`` fields it has (the backbone's sizes are not in that file:
    Isaac-GR00T takes them from Eagle-Block2A-2B-v2, whose published sizes ``base`` carries)."""
    if "loong" in data:
        fields = dict(data["loong"]["config"])
        fields["image_size"] = tuple(fields["image_size"])
        return GrootN16Config(**fields)
    base = base or GrootN16Config()
    changes = {ours: data[theirs] for ours, theirs in _GROOT_FIELDS.items() if theirs in data}
    dit = data.get("diffusion_model_cfg") or {}
    changes.update({ours: dit[theirs] for ours, theirs in _DIT_FIELDS.items() if theirs in dit})
    if data.get("backbone_embedding_dim", base.text_hidden_size) != base.text_hidden_size:
        raise LoongError(f"groot_n1_6 config.json: backbone_embedding_dim={data['backbone_embedding_dim']} differs "
                         f"from the Eagle LM width {base.text_hidden_size}")
    changes["n_action_steps"] = min(base.n_action_steps, changes.get("chunk_size", base.chunk_size))
    return dataclasses.replace(base, **changes)


# --- folders -----------------------------------------------------------------------------------------------------
def read_published_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a published-layout folder (one file, or the shards its index names), published names."""
    from safetensors.torch import load_file

    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict):
            raise LoongError(f"{index}: no 'weight_map' object")
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            path = directory / shard
            if not path.is_file():
                raise LoongError(f"{index}: names shard {shard!r}, which {directory} lacks")
            tensors.update(load_file(str(path)))
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise LoongError(f"{index}: {len(missing)} keys are in no shard, e.g. {missing[0]!r}")
        return tensors
    single = directory / WEIGHTS_FILE
    if single.is_file():
        return load_file(str(single))
    raise LoongError(f"{directory}: neither {WEIGHTS_FILE} nor {INDEX_FILE} (not a GR00T N1.6 checkpoint folder)")


def load_published(policy: torch.nn.Module, directory: str | Path) -> list[str]:
    """Load a published-layout folder into ``policy`` (cast to its dtypes); every Loong parameter must be present.

    Returns the skipped published keys (the unused ``lm_head`` / pooling head)."""
    ours, skipped = from_published(read_published_weights(directory))
    expected = policy.state_dict()
    missing = sorted(set(expected) - set(ours))
    unexpected = sorted(set(ours) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {to_published_name(missing[0])!r})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {to_published_name(unexpected[0])!r})")
        raise LoongError(f"{directory}: weights do not fit this GR00T N1.6 config: {'; '.join(parts)}")
    for name, tensor in ours.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise LoongError(f"{directory}: {to_published_name(name)!r} has shape {list(tensor.shape)}; this config "
                             f"needs {list(expected[name].shape)}")
    policy.load_state_dict({k: v.to(expected[k].dtype) for k, v in ours.items()}, strict=True)
    return skipped


def save_published(policy: torch.nn.Module, config: GrootN16Config, directory: str | Path, *,
                   dtype: torch.dtype | None = None, max_shard_bytes: int | None = None) -> Path:
    """Write ``policy`` as a published-layout folder (``dtype``: cast floats, e.g. bf16 as published;
    ``max_shard_bytes``: split into ``model-0000i-of-0000n.safetensors`` shards with an index)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, tensor in to_published(policy.state_dict()).items():
        t = tensor.detach().cpu()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[key] = t.contiguous().clone()
    (directory / CONFIG_FILE).write_text(json.dumps(published_config(config), indent=2, default=list),
                                         encoding="utf-8")
    if max_shard_bytes is None:
        save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        return directory
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                   indent=2), encoding="utf-8")
    return directory


def read_published_config(directory: str | Path, base: GrootN16Config | None = None) -> GrootN16Config:
    """The config of a published-layout folder's ``config.json`` (see :func:`config_from_published`)."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise LoongError(f"{directory}: no {CONFIG_FILE}")
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("model_type") not in ("Gr00tN1d6", None):
        raise LoongError(f"{path}: model_type {data.get('model_type')!r} is not a GR00T N1.6 ('Gr00tN1d6')")
    return config_from_published(data, base)


__all__ = [
    "PREFIXES", "UNUSED_PUBLISHED_PREFIXES", "config_from_published", "from_published", "from_published_name",
    "load_published", "published_config", "read_published_config", "read_published_weights", "save_published",
    "to_published", "to_published_name",
]
