"""Wan ↔ diffusers (``WanTransformer3DModel``): the parameter names, declared once in :data:`RULES`, the config
fields, and diffusers' folder format (``config.json`` + safetensors, sharded with an index or not).

Each rule pairs a Loong module (or parameter) path with the diffusers path(s) it holds; ``{n}`` is a block index and
the parameter's own name (``.weight``, ``.bias``) follows both. A rule with several diffusers paths is a fusion
along dim 0 in that order: Loong's ``self_attn.qkv`` is diffusers' ``to_q``, ``to_k`` and ``to_v`` stacked.
:func:`from_diffusers` concatenates, :func:`to_diffusers` splits; both are exact, so a round trip is bit for bit.

Loading never unpickles: only safetensors are read; a folder that has only ``.bin`` weights is refused.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from loong.core.attention import CPGroups
from loong.core.checkpoint.safetensors_io import SafetensorsFolder, read_json, write_shards
from loong.core.errors import LoongError
from loong.diffusion.models.wan.config import WanConfig
from loong.diffusion.models.wan.model import WanTransformer

CLASS_NAME = "WanTransformer3DModel"
CONFIG_NAME = "config.json"
#: diffusers' weight file stem: ``<stem>.safetensors`` or ``<stem>-0000i-of-0000N.safetensors`` + the index
WEIGHTS_STEM = "diffusion_pytorch_model"
WEIGHTS_NAME = f"{WEIGHTS_STEM}.safetensors"
INDEX_NAME = f"{WEIGHTS_STEM}.safetensors.index.json"
#: diffusers' own default shard size for ``save_pretrained``
MAX_SHARD_BYTES = 10 * 2**30


@dataclass(frozen=True)
class Rule:
    """A Loong path and the diffusers path(s) it holds (several: fused along dim 0, in this order)."""

    loong: str
    diffusers: tuple[str, ...]


_B = "blocks.{n}"
_IMG = "condition_embedder.image_embedder"
RULES: tuple[Rule, ...] = (
    Rule("patch_embed", ("patch_embedding",)),
    Rule("condition.time_in", ("condition_embedder.time_embedder.linear_1",)),
    Rule("condition.time_out", ("condition_embedder.time_embedder.linear_2",)),
    Rule("condition.time_modulation", ("condition_embedder.time_proj",)),
    Rule("condition.text_in", ("condition_embedder.text_embedder.linear_1",)),
    Rule("condition.text_out", ("condition_embedder.text_embedder.linear_2",)),
    Rule("condition.image.pos_embed", (f"{_IMG}.pos_embed",)),
    Rule("condition.image.norm_in", (f"{_IMG}.norm1",)),
    Rule("condition.image.fc1", (f"{_IMG}.ff.net.0.proj",)),
    Rule("condition.image.fc2", (f"{_IMG}.ff.net.2",)),
    Rule("condition.image.norm_out", (f"{_IMG}.norm2",)),
    Rule(f"{_B}.modulation", (f"{_B}.scale_shift_table",)),
    Rule(f"{_B}.self_attn.qkv", (f"{_B}.attn1.to_q", f"{_B}.attn1.to_k", f"{_B}.attn1.to_v")),
    Rule(f"{_B}.self_attn.q_norm", (f"{_B}.attn1.norm_q",)),
    Rule(f"{_B}.self_attn.k_norm", (f"{_B}.attn1.norm_k",)),
    Rule(f"{_B}.self_attn.out", (f"{_B}.attn1.to_out.0",)),
    Rule(f"{_B}.cross_norm", (f"{_B}.norm2",)),
    Rule(f"{_B}.cross_attn.q", (f"{_B}.attn2.to_q",)),
    Rule(f"{_B}.cross_attn.kv", (f"{_B}.attn2.to_k", f"{_B}.attn2.to_v")),
    Rule(f"{_B}.cross_attn.q_norm", (f"{_B}.attn2.norm_q",)),
    Rule(f"{_B}.cross_attn.k_norm", (f"{_B}.attn2.norm_k",)),
    Rule(f"{_B}.cross_attn.image_kv", (f"{_B}.attn2.add_k_proj", f"{_B}.attn2.add_v_proj")),
    Rule(f"{_B}.cross_attn.image_k_norm", (f"{_B}.attn2.norm_added_k",)),
    Rule(f"{_B}.cross_attn.out", (f"{_B}.attn2.to_out.0",)),
    Rule(f"{_B}.ffn.fc1", (f"{_B}.ffn.net.0.proj",)),
    Rule(f"{_B}.ffn.fc2", (f"{_B}.ffn.net.2",)),
    Rule("head_modulation", ("scale_shift_table",)),
    Rule("head", ("proj_out",)),
)
#: diffusers checkpoint keys it skips on load (``_keys_to_ignore_on_load_unexpected``); Wan has no such weights
IGNORED = re.compile(r"(^|\.)norm_added_q(\.|$)")

#: parameters kept in float32 when a model is loaded in a lower precision, as diffusers keeps them
#: (``_keep_in_fp32_modules``): the modulation tables, the timestep MLP and the cross-attention norm — small, and
#: what the float32 modulation arithmetic reads
KEEP_FP32 = re.compile(r"(^|\.)(modulation|head_modulation|time_in|time_out|cross_norm)(\.|$)")

#: Loong config fields named differently in diffusers' config.json; the other shape fields share their names
_CONFIG_RENAMES = {"num_heads": "num_attention_heads", "head_dim": "attention_head_dim"}
#: Loong config fields that live in diffusers' pipeline (model_index.json), not in the transformer's config
_PIPELINE_FIELDS = ("experts", "boundary_ratio", "expand_timesteps")


def _pattern(template: str) -> re.Pattern[str]:
    """A full-name regex for ``template``: ``{n}`` a block index, then an optional one-component leaf."""
    return re.compile("^" + re.escape(template).replace(r"\{n\}", r"(?P<n>\d+)") + r"(?P<leaf>\.[^.]+)?$")


_LOONG = [(_pattern(rule.loong), rule) for rule in RULES]
_DIFFUSERS = [(_pattern(name), rule, i) for rule in RULES for i, name in enumerate(rule.diffusers)]


def _fill(template: str, match: re.Match[str]) -> str:
    n = match.groupdict().get("n")
    return (template if n is None else template.replace("{n}", n)) + (match["leaf"] or "")


def to_diffusers(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Loong Wan state dict under diffusers' names (fused tensors split; views, no copies)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        found = next(((m, rule) for pattern, rule in _LOONG if (m := pattern.match(key))), None)
        if found is None:
            raise LoongError(f"{key!r} is not a Wan parameter (no diffusers name is declared for it)")
        match, rule = found
        parts = len(rule.diffusers)
        if tensor.shape[0] % parts:
            raise LoongError(f"{key!r} of shape {tuple(tensor.shape)} does not split into {parts} equal parts")
        for name, piece in zip(rule.diffusers, tensor.chunk(parts, dim=0) if parts > 1 else (tensor,), strict=True):
            out[_fill(name, match)] = piece
    return out


def from_diffusers(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers ``WanTransformer3DModel`` state dict under Loong's names (fused parts concatenated).

    Every key must be declared in :data:`RULES` (or be one diffusers ignores); an unknown or an incomplete set of
    fused parts is a :class:`LoongError` naming the key.
    """
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for key in state_dict:
        if IGNORED.search(key):
            used.add(key)
            continue
        found = next(((m, rule, i) for pattern, rule, i in _DIFFUSERS if (m := pattern.match(key))), None)
        if found is None:
            raise LoongError(f"{key!r} is not a Wan transformer weight that Loong knows (diffusers "
                             f"{CLASS_NAME}, see loong.diffusion.models.wan.mapping.RULES)")
        match, rule, index = found
        if index:
            continue  # gathered with the rule's first part
        names = [_fill(name, match) for name in rule.diffusers]
        missing = [name for name in names if name not in state_dict]
        if missing:
            raise LoongError(f"{key!r} is fused with {', '.join(map(repr, missing))} in Loong, which the "
                             "checkpoint lacks")
        tensors = [state_dict[name] for name in names]
        out[_fill(rule.loong, match)] = torch.cat(tensors, dim=0) if len(tensors) > 1 else tensors[0]
        used.update(names)
    orphans = sorted(set(state_dict) - used)
    if orphans:
        raise LoongError(f"{orphans[0]!r} is a fused part without its first part in the checkpoint")
    return out


def config_to_diffusers(config: WanConfig) -> dict[str, Any]:
    """``config.json`` of a ``WanTransformer3DModel`` with this shape (pipeline-level fields left out)."""
    out: dict[str, Any] = {"_class_name": CLASS_NAME, "_diffusers_version": metadata.version("diffusers")}
    for field in dataclasses.fields(config):
        if field.name in _PIPELINE_FIELDS:
            continue
        value = getattr(config, field.name)
        out[_CONFIG_RENAMES.get(field.name, field.name)] = list(value) if isinstance(value, tuple) else value
    return out


def config_from_diffusers(config: Mapping[str, Any], **pipeline: Any) -> WanConfig:
    """A :class:`WanConfig` from a diffusers ``config.json`` dict; ``pipeline`` sets the fields diffusers keeps in
    the pipeline (``experts``, ``boundary_ratio``, ``expand_timesteps``). Fields Loong does not know fail, since
    ignoring one could build a different model."""
    if config.get("_class_name", CLASS_NAME) != CLASS_NAME:
        raise LoongError(f"a {config['_class_name']} config is not a Wan transformer ({CLASS_NAME})")
    names = {_CONFIG_RENAMES.get(f.name, f.name): f.name for f in dataclasses.fields(WanConfig)
             if f.name not in _PIPELINE_FIELDS}
    unknown = [key for key in config if not key.startswith("_") and key not in names]
    if unknown:
        raise LoongError(f"unknown {CLASS_NAME} config field(s) {', '.join(unknown)}")
    bad = [key for key in pipeline if key not in _PIPELINE_FIELDS]
    if bad:
        raise LoongError(f"{', '.join(bad)} are not pipeline fields of Wan (those are {', '.join(_PIPELINE_FIELDS)})")
    values = {names[key]: value for key, value in config.items() if key in names}
    return WanConfig(**values, **pipeline)


def read_diffusers_folder(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``config.json`` and the diffusers-named weights of a ``WanTransformer3DModel`` folder (one safetensors file,
    or shards with their index)."""
    config, folder = open_diffusers_folder(path)
    return config, folder.load_all()


def open_diffusers_folder(path: str | Path) -> tuple[dict[str, Any], SafetensorsFolder]:
    """``config.json`` and the (not yet read) weights of a ``WanTransformer3DModel`` folder, with
    :func:`read_diffusers_folder`'s one-line errors."""
    path = Path(path)
    if not (path / CONFIG_NAME).is_file():
        hint = f"; this looks like a pipeline folder, pass {path / 'transformer'}" if (
            path / "transformer" / CONFIG_NAME).is_file() else ""
        raise LoongError(f"{path} has no {CONFIG_NAME} of a diffusers transformer{hint}")
    config = read_json(path / CONFIG_NAME)
    if not (path / WEIGHTS_NAME).is_file() and not (path / INDEX_NAME).is_file():
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        raise LoongError(f"{path} has no {WEIGHTS_NAME} (nor {INDEX_NAME})"
                         + (f"; Loong does not unpickle {', '.join(pickles)}: convert it to safetensors"
                            if pickles else ""))
    # the shards of the index (or the single file), every tensor the index names present: one-line errors
    return config, SafetensorsFolder(path, stem=WEIGHTS_STEM, what="diffusers folder")


def check_diffusers_weights(path: str | Path, config: WanConfig, weights: Mapping[str, torch.Tensor]) -> None:
    """Raise LoongError naming the first diffusers tensor of the folder ``path`` that a Wan of ``config`` lacks, does
    not have, or has in another shape, or that is not floating point (it would load as garbage weights)."""
    with torch.device("meta"):
        expected = to_diffusers(WanTransformer(config).state_dict())
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or extra:  # e.g. an I2V folder whose config lacks image_dim
        raise LoongError(f"{path}: the weights do not match its {CONFIG_NAME} (missing {missing[:3]}, "
                         f"unexpected {extra[:3]})")
    for key, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise LoongError(f"{path}: {key} has shape {tuple(tensor.shape)}, its {CONFIG_NAME} implies "
                             f"{tuple(expected[key].shape)}")
        if not tensor.is_floating_point():
            raise LoongError(f"{path}: {key} is {tensor.dtype}; model weights must be floating point")


def load_diffusers(path: str | Path, groups: CPGroups | None = None, capabilities: Collection[str] = (), *,
                   dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                   **pipeline: Any) -> WanTransformer:
    """A :class:`WanTransformer` with the weights of a diffusers transformer folder.

    The model is built on the meta device and takes the loaded tensors as its parameters (no second copy);
    ``dtype``/``device`` convert them (default: as stored, on the CPU), except that a ``dtype`` below float32 leaves
    the :data:`KEEP_FP32` parameters in float32, as diffusers does. ``pipeline``: see :func:`config_from_diffusers`.
    """
    raw_config, weights = read_diffusers_folder(path)
    config = config_from_diffusers(raw_config, **pipeline)
    check_diffusers_weights(path, config, weights)
    with torch.device("meta"):
        model = WanTransformer(config, groups, capabilities)
    keep = dtype is not None and dtype.is_floating_point and torch.finfo(dtype).bits < 32
    state = {key: value.to(device=device, dtype=(torch.float32 if keep and KEEP_FP32.search(key) else dtype)
                           if value.is_floating_point() else None)
             for key, value in from_diffusers(weights).items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model


def save_diffusers(state_dict: Mapping[str, torch.Tensor], config: WanConfig, path: str | Path, *,
                   max_shard_bytes: int = MAX_SHARD_BYTES, progress: Any = None) -> Path:
    """Write a folder that ``WanTransformer3DModel.from_pretrained`` loads: ``config.json`` and the weights of the
    Loong ``state_dict`` (whole tensors, e.g. ``model.state_dict()``) in diffusers' names and dtypes, one
    safetensors file or, above ``max_shard_bytes``, numbered shards with diffusers' index. ``progress``: a rich
    ``(bar, task)`` advanced by each tensor's elements. Returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # the core's shard writer: diffusers' file names and index, views of fused weights copied, stale shards removed
    write_shards(path, to_diffusers(state_dict).items(), max_shard_bytes, stem=WEIGHTS_STEM, progress=progress)
    (path / CONFIG_NAME).write_text(json.dumps(config_to_diffusers(config), indent=2, sort_keys=True) + "\n")
    return path


__all__ = ["RULES", "Rule", "config_from_diffusers", "config_to_diffusers", "from_diffusers", "load_diffusers",
           "open_diffusers_folder", "read_diffusers_folder", "save_diffusers", "to_diffusers"]
