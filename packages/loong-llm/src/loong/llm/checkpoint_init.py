"""A Loong LLM checkpoint as the starting weights of another run: ``model.init_from`` (loong-llm) and
``foundation.init_from`` (loong-vlm, whose foundation is this package's model).

The checkpoint's saved config sets the model's shape (as an HF folder's config.json does for ``init_from_hf``);
the run keeps its own training fields (:data:`~loong.llm.models.config.TRAINING_FIELDS`). The weights are read
whole (megatron-core's plain-tensor load: any TP/PP/EP layout the checkpoint was saved at) and copied into each
rank's slices; optimiser state and the step are not taken (a fresh run; ``train.resume`` continues a run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from loong.core.checkpoint import read_config, resolve_checkpoint
from loong.core.config.schema import ParallelConfig, from_dict
from loong.core.errors import LoongError
from loong.llm.lora import is_adapter_key
from loong.llm.lora import merge_lora as merge
from loong.llm.models.config import TRAINING_FIELDS, DenseModelConfig
from loong.llm.models.hf_mapping import native_shapes


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """A one-process CPU group for megatron's checkpoint reader when none exists (``convert``); a training run's
    own group otherwise."""
    if dist.is_initialized():
        yield
        return
    from loong.core.accelerators import select_accelerator
    from loong.core.engines.megatron.layout import init_distributed, shutdown_distributed

    accelerator = select_accelerator("cpu")
    with accelerator.activate():
        init_distributed(accelerator, ParallelConfig())
        try:
            yield
        finally:
            shutdown_distributed()


def checkpoint_model_config(path: str | Path, keep: DenseModelConfig | None = None,
                            key: str | None = "model.init_from") -> DenseModelConfig:
    """The model config a loong-llm checkpoint (run, checkpoints or step folder: its newest step) was trained with;
    ``keep`` donates the run's training fields. ``key`` names the option in errors (None: no name)."""
    from loong.llm.schema import LLMRunConfig

    named = f"{key}: " if key else ""
    try:
        step_dir = resolve_checkpoint(Path(path))
        saved = read_config(step_dir)
    except LoongError as exc:
        raise LoongError(f"{named}{exc}") from None
    if not isinstance(saved.get("model"), dict) or "num_layers" not in saved["model"]:
        raise LoongError(f"{named}{step_dir} is not a loong-llm checkpoint (its config has no model.num_layers)")
    cfg = from_dict(LLMRunConfig, saved).model
    cfg.init_from = cfg.init_from_hf = None
    if keep is not None:
        for name in TRAINING_FIELDS:
            setattr(cfg, name, getattr(keep, name))
    return cfg


def read_model_weights(path: str | Path, merge_lora: bool = False,
                       key: str | None = "model.init_from") -> tuple[DenseModelConfig, dict[str, torch.Tensor], Path]:
    """``(model config, whole native tensors, step folder)`` of a loong-llm checkpoint. A LoRA checkpoint needs
    ``merge_lora`` (its adapters are merged into the base weights)."""
    step_dir = resolve_checkpoint(Path(path))
    model_cfg = checkpoint_model_config(step_dir, key=key)
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors

    with process_group():
        plain = load_plain_tensors(str(step_dir))
    wanted = native_shapes(model_cfg)
    adapters = [k for k in plain if is_adapter_key(k) and not k.startswith("optimizer.")]
    if adapters and not merge_lora:
        raise LoongError(f"{step_dir} is a LoRA checkpoint ({len(adapters)} adapter tensors, model.lora.rank="
                         f"{model_cfg.lora.rank})")
    if adapters:
        plain = merge({k: plain[k] for k in [*wanted, *adapters] if k in plain}, model_cfg.lora)
    native = {k: v for k, v in plain.items() if k in wanted}
    missing = sorted(set(wanted) - set(native))
    if missing:
        raise LoongError(f"{step_dir} lacks model tensors {missing[:3]} for its config")
    return model_cfg, native, step_dir


def load_checkpoint_into(model_chunks: list[torch.nn.Module], cfg: DenseModelConfig, prefix: str = "",
                         key: str = "model.init_from") -> None:
    """Copy the weights of the checkpoint ``cfg.init_from`` into this rank's slices of ``model_chunks``, whose
    model tensors are keyed ``prefix + <native key>`` (loong-vlm: ``foundation.``); only those are loaded. A LoRA
    run's adapters keep their initialisation."""
    from loong.core.engines.megatron.state import load_full_state

    _, native, _ = read_model_weights(cfg.init_from, merge_lora=True, key=key)  # a LoRA run: the merged model
    full = {prefix + k: v for k, v in native.items()}
    if cfg.lora.rank > 0:
        from loong.llm.lora import load_base_state

        load_base_state(model_chunks, full)
    else:
        load_full_state(model_chunks, full, select=(lambda k: k.startswith(prefix)) if prefix else None)


__all__ = ["checkpoint_model_config", "load_checkpoint_into", "process_group", "read_model_weights"]
