"""``loong-llm convert SRC DST``: Hugging Face folder ⇄ Loong checkpoint; direction from SRC.

An HF folder becomes a weights-only Loong checkpoint (layout-independent: train it at any TP/PP with
``train.resume=DST``); a Loong checkpoint becomes an HF folder that ``from_pretrained`` loads.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from loong.core.accelerators import select_accelerator
from loong.core.checkpoint import CheckpointManager, resolve_checkpoint
from loong.core.config.schema import ParallelConfig
from loong.core.engines.megatron.layout import init_distributed, shutdown_distributed
from loong.core.errors import LoongError
from loong.llm.checkpoint_init import read_model_weights
from loong.llm.hf import load_hf_into, model_config_from_hf, write_hf
from loong.llm.models.build import build_gpt_model, transformer_config
from loong.llm.schema import LLMRunConfig

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


class _WeightsOnly:
    """The slice of an engine the checkpoint manager needs, for a model without an optimiser."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def save(self, directory: Path) -> None:
        from megatron.core import dist_checkpointing

        dist_checkpointing.save({"model": self.model.sharded_state_dict()}, str(directory))


def _is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file()


def hf_to_loong(src: Path, dst: Path, dtype: str = "auto") -> Path:
    """Import an HF folder as a weights-only Loong checkpoint under ``dst/checkpoints``."""
    model_cfg = model_config_from_hf(src)
    accelerator = select_accelerator("cpu")
    with accelerator.activate():
        layout = init_distributed(accelerator, ParallelConfig())
        try:
            torch_dtype = _DTYPES.get(dtype, torch.float32)
            config = transformer_config(model_cfg, ParallelConfig(), torch_dtype,
                                        accelerator.megatron_config_overrides())
            model = build_gpt_model(model_cfg, config, accelerator.capabilities(), True, True,
                                    layout.pg_collection)
            load_hf_into([model], src, model_cfg)
            run_cfg = LLMRunConfig(model=model_cfg, run_name=dst.name, output_dir=str(dst.parent))
            from loong.core.config.schema import to_dict

            def artifacts(step_dir: Path) -> None:
                tok_files = [p for p in src.iterdir() if p.name.startswith(("tokenizer", "special_tokens",
                                                                             "vocab", "merges"))]
                if tok_files:
                    (step_dir / "tokenizer").mkdir()
                    for f in tok_files:
                        shutil.copy2(f, step_dir / "tokenizer" / f.name)

            state = {"step": 0, "weights_only": True, "source": str(src)}
            CheckpointManager(dst / "checkpoints").save(0, _WeightsOnly(model), state, to_dict(run_cfg),
                                                        artifacts=artifacts)
        finally:
            shutdown_distributed()
    return dst / "checkpoints"


def loong_to_hf(src: Path, dst: Path, dtype: str = "auto", merge_lora: bool = False) -> Path:
    """Export a Loong checkpoint (any layout it was saved at) as an HF folder.

    A checkpoint with LoRA adapters needs ``merge_lora=True`` (``--merge-lora``): the adapters are
    merged into the base weights (``W + alpha/rank·B@A``); without it nothing is written.
    """
    try:
        model_cfg, native, step_dir = read_model_weights(src, merge_lora=merge_lora, key=None)
    except LoongError as exc:
        if "LoRA checkpoint" in str(exc):
            raise LoongError(f"{exc}; pass --merge-lora to merge the adapters into the Hugging Face weights") from None
        raise
    saved_dtype = next(iter(native.values())).dtype
    out_dtype = _DTYPES.get(dtype, saved_dtype)
    tokenizer = step_dir / "tokenizer"
    return write_hf(native, model_cfg, dst, out_dtype, tokenizer_dir=tokenizer if tokenizer.is_dir() else None)


def convert(src: str | Path, dst: str | Path, dtype: str = "auto", merge_lora: bool = False) -> Path:
    """Convert in the direction SRC implies. Nothing is written when SRC is not understood.

    ``merge_lora``: merge a LoRA checkpoint's adapters into the written HF weights (Loong → HF only).
    """
    src_p, dst_p = Path(src), Path(dst)
    if not src_p.exists():
        raise LoongError(f"{src} does not exist")
    if _is_hf_folder(src_p):
        if merge_lora:
            raise LoongError(f"--merge-lora applies to a Loong checkpoint; {src} is a Hugging Face folder")
        return hf_to_loong(src_p, dst_p, dtype)
    try:
        resolve_checkpoint(src_p, verify=False)  # is it a checkpoint at all? (integrity: below)
    except LoongError as exc:
        if "not a Loong checkpoint" not in str(exc):  # a checkpoint, but broken: say how
            raise
        raise LoongError(
            f"{src} is neither a Hugging Face model folder (no config.json) nor a Loong checkpoint "
            "(no manifest.json, trainer_state.json or step_* directories)"
        ) from None
    return loong_to_hf(src_p, dst_p, dtype, merge_lora=merge_lora)
