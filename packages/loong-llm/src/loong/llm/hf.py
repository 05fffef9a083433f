"""Online use of Hugging Face checkpoints: check a folder, load it into a model, export a model.

The tensor mapping is declared once per family (``models/<family>/``, ``models/hf_mapping.py``);
this module only moves whole tensors between an HF folder and a model at any TP/PP layout.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loong.core.engines.megatron.state import gather_full_state, load_full_state
from loong.core.errors import LoongError
from loong.llm.hf_io import read_hf_folder, write_hf_folder
from loong.llm.models.config import TRAINING_FIELDS, DenseModelConfig
from loong.llm.models.hf_mapping import family_by_name, family_for_hf_config, hf_to_native, native_to_hf

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """config.json of an HF folder, with a one-line error when it is not one."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoongError(f"{path} is not a folder")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise LoongError(f"{path} has no config.json; it is not a Hugging Face model folder")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise LoongError(f"{cfg_file}: not valid JSON ({exc})") from None


def model_config_from_hf(path: str | Path, keep: DenseModelConfig | None = None) -> DenseModelConfig:
    """The model config of an HF folder (architecture checked); ``keep`` donates Loong-only fields."""
    hf_config = read_hf_config(path)
    family = family_for_hf_config(hf_config, source=str(path))
    cfg = family.config_from_hf(hf_config)
    cfg.preset = Path(path).name
    if cfg.mtp_num_layers and not _has_tensor_prefix(Path(path), f"model.layers.{cfg.num_layers}."):
        # transformers' DeepseekV3ForCausalLM writes num_nextn_predict_layers but not the MTP weights: the
        # model then has no MTP modules (rather than randomly initialised ones mixed into pretrained weights)
        cfg.mtp_num_layers = 0
    if keep is not None:  # the run's own choices (recompute, kernels, DSA stage, ...) over the folder's defaults
        for name in TRAINING_FIELDS:
            setattr(cfg, name, getattr(keep, name))
    return cfg


def _has_tensor_prefix(folder: Path, prefix: str) -> bool:
    """Whether the folder's safetensors name a tensor starting with ``prefix`` (headers only, no weights read)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return any(k.startswith(prefix) for k in json.loads(index.read_text()).get("weight_map", {}))
    weights = folder / "model.safetensors"
    if not weights.is_file():
        return False
    from safetensors import safe_open

    with safe_open(weights, framework="pt") as f:
        return any(k.startswith(prefix) for k in f.keys())  # noqa: SIM118 (safe_open is not a dict)


def check_hf_folder(path: str | Path, expect_family: str | None = None) -> None:
    """Fail early (before any heavy work) when ``path`` is not a supported HF checkpoint."""
    family = family_for_hf_config(read_hf_config(path), source=str(path))
    if expect_family is not None and family.name != expect_family:
        raise LoongError(f"{path} is a {family.name} checkpoint but model.family is {expect_family}")


def load_hf_into(model_chunks: list[torch.nn.Module], path: str | Path, cfg: DenseModelConfig) -> None:
    """Load an HF folder's weights into this rank's slices of the model."""
    hf_config, state = read_hf_folder(path)
    family_for_hf_config(hf_config, source=str(path))
    odd = next((k for k, t in state.items() if not t.is_floating_point()), None)
    if odd is not None:  # an integer tensor would be cast silently into garbage weights
        raise LoongError(f"{path}: {odd} is {state[odd].dtype}; model weights must be floating point")
    try:
        native = hf_to_native(state, cfg)
    except LoongError as exc:  # name the folder: the mapping only knows tensor names
        raise LoongError(f"{path}: {exc}") from None
    if cfg.lora.rank > 0:
        from loong.llm.lora import load_base_state

        load_base_state(model_chunks, native)  # the adapters keep their initialisation
    else:
        load_full_state(model_chunks, native)


def write_hf(native: dict[str, torch.Tensor], cfg: DenseModelConfig, out_dir: Path, dtype: torch.dtype,
             tokenizer_dir: Path | None = None) -> Path:
    """Write whole native tensors as an HF folder in ``dtype``."""
    family = family_by_name(cfg.family)
    state = {k: v.to(dtype) for k, v in native_to_hf(native, cfg).items()}
    return write_hf_folder(out_dir, family.hf_config_dict(cfg, _DTYPE_NAMES[dtype]), state,
                           tokenizer_dir=tokenizer_dir)


def export_model(model_chunks: list[torch.nn.Module], cfg: DenseModelConfig, out_dir: Path,
                 tokenizer: Any = None) -> Path:
    """Gather the model from every rank and write an HF folder on rank 0 (collective).

    LoRA adapters are merged into their base weights (``W + alpha/rank·B@A``, in fp32).
    """
    dtype = next(p for c in model_chunks for p in c.parameters()).dtype
    full = gather_full_state(model_chunks)
    if cfg.lora.rank > 0:
        from loong.llm.lora import merge_lora

        full = merge_lora(full, cfg.lora)
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_hf(full, dataclasses.replace(cfg), out_dir, dtype)
        if tokenizer is not None:
            tokenizer.save(out_dir)
    if dist.is_initialized():
        dist.barrier()
    return out_dir
