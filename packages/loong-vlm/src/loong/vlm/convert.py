"""``loong-vlm convert SRC DST``: Hugging Face VLM folder ⇄ Loong checkpoint; the direction comes from SRC, as in
``loong-llm convert``.

An HF folder (``Qwen2_5_VLForConditionalGeneration``, ``Qwen3VLForConditionalGeneration``,
``Qwen3VLMoeForConditionalGeneration``, ``InternVLForConditionalGeneration``) becomes a weights-only Loong
checkpoint under ``DST/checkpoints`` (layout-independent: ``loong-vlm train train.resume=DST`` starts a fresh run
from its weights at any TP/PP, its config setting the shapes), with the folder's processor beside it when it
has one. A Loong checkpoint (a run, its ``checkpoints`` folder or one step) becomes an HF folder that
``from_pretrained`` loads, with the processor the checkpoint was trained with (or ``--processor DIR``), in
safetensors shards of at most ``max_shard_bytes`` with ``model.safetensors.index.json``. :func:`verify` rereads
both sides and compares every tensor bit for bit.

Both directions stream (docs/convert.md states the measured bound). Loong -> HF reads one native tensor at a time
from the checkpoint's torch-DCP files (loong-llm's :class:`~loong.llm.convert.CheckpointTensors`: only that
tensor's chunks, whatever layout wrote them), maps it to its HF tensors (:class:`~loong.vlm.hf.KeyMapping`: a
foundation tensor stacks every layer, e.g. the fused QKV, and gives them all) and queues them in the core's
``ShardWriter`` before the next is read: memory holds about the largest native tensor (twice where the mapping
builds new tensors: Qwen3-VL-MoE's fused experts) plus one shard. HF -> Loong reads the folder one tensor at a time
while filling the model, one native tensor (a foundation tensor: one layer of it) at a time, each HF tensor read
once; the built model, the Loong state, is held once, as megatron-core's save of a built model needs it (its
``_extra_state`` and common state go with the tensors). :func:`verify` compares tensor by tensor, holding one
native tensor's HF tensors and one HF tensor.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from loong.core.accelerators import select_accelerator
from loong.core.checkpoint import CheckpointManager, read_config, resolve_checkpoint
from loong.core.checkpoint.safetensors_io import (
    CONVERT_DTYPES,
    DEFAULT_MAX_SHARD_BYTES,
    TensorSource,
    compare_tensors,
    convert_dtype,
    verify_summary,
)
from loong.core.config.schema import ParallelConfig, from_dict, to_dict
from loong.core.engines.megatron.layout import world
from loong.core.errors import LoongError
from loong.llm.convert import CheckpointTensors
from loong.vlm.hf import (
    KeyMapping,
    fill_from_hf,
    has_processor,
    layout_of,
    load_processor_folder,
    native_shapes,
    open_hf_folder,
    parts_from_folder,
    write_hf_tensors,
)
from loong.vlm.hf_config import VLMParts, adopt_parts, check_parts, hf_config_of
from loong.vlm.schema import VLMRunConfig

#: ``--dtype`` choices besides ``auto`` (the source's dtype), as in ``loong-llm convert``
DTYPES = CONVERT_DTYPES
#: the sections of a loong-vlm run config that make the model
SECTIONS = ("model", "encoder", "projector", "foundation")


class _WeightsOnly:
    """The slice of an engine the checkpoint manager needs, for a model without an optimiser."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def save(self, directory: Path) -> None:
        from megatron.core import dist_checkpointing

        dist_checkpointing.save({"model": self.model.sharded_state_dict()}, str(directory))


def checkpoint_parts(step_dir: Path) -> VLMParts:
    """The four model configs a loong-vlm checkpoint was saved with."""
    saved = read_config(step_dir)
    missing = [s for s in SECTIONS if s not in saved]
    if missing:
        raise LoongError(f"{step_dir} is not a loong-vlm checkpoint (its config has no {', '.join(missing)} "
                         "section)")
    run = from_dict(VLMRunConfig, {s: saved[s] for s in SECTIONS})
    return VLMParts.of(run)


def adopt_resume_checkpoint(cfg: Any) -> None:
    """An explicit ``train.resume=CKPT`` defines the model it holds (as in loong-llm; the core takes its ``model``
    section, command-line ``model.*`` keys winning): here also its ``encoder``, ``projector`` and ``foundation``
    shapes, the run keeping its training fields; with ``data.processor`` unset, the data reads with the processor
    saved beside the checkpoint (the model's placeholder tokens are its tokenizer's). ``auto`` / ``none`` do
    nothing."""
    if cfg.train.resume in ("auto", "none", "never", ""):
        return
    step_dir = resolve_checkpoint(cfg.train.resume, verify=False)  # checksums: after dist init, by the core
    donor = checkpoint_parts(step_dir)
    adopt_parts(cfg, VLMParts(cfg.model, donor.encoder, donor.projector, donor.foundation))
    if cfg.data.processor is None and has_processor(step_dir / "processor"):
        cfg.data.processor = str(step_dir / "processor")


def _build(parts: VLMParts, dtype: torch.dtype, accelerator: Any, layout: Any) -> torch.nn.Module:
    """The whole VLM (one chunk) as ``loong-vlm train`` builds it, on CPU, in ``dtype``."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from loong.vlm.task import VLMTask

    cfg = VLMRunConfig()
    parts.apply_to(cfg)
    model_parallel_cuda_manual_seed(cfg.train.seed)
    task = VLMTask(cfg, accelerator, layout)
    model = task.build_model(task.model_config(dtype), True, True, None)
    for part in (model.encoder, model.projector):  # plain modules: built in fp32; megatron's are in ``dtype``
        part.to(dtype)
    return model


def hf_to_loong(src: Path, dst: Path, dtype: str = "auto", progress: bool = False) -> Path:
    """Import an HF VLM folder as a weights-only Loong checkpoint under ``dst/checkpoints`` (its processor, when
    the folder has one, under the step's ``processor/``). ``dtype`` ``auto`` keeps the folder's (the most common
    floating dtype of its tensors, read from the safetensors headers), as ``loong-llm convert`` does. The folder's
    names and shapes are checked before the model is built, then it is read one tensor at a time into the model
    (:func:`~loong.vlm.hf.load_hf_into`)."""
    parts = parts_from_folder(src)
    hf, mapping = open_hf_folder(src, parts)
    torch_dtype = convert_dtype(dtype, (hf.meta(k)[1] for k in hf.keys()), str(src))
    processor = load_processor_folder(src) if has_processor(src) else None
    run_cfg = VLMRunConfig(run_name=dst.name, output_dir=str(dst.parent))
    parts.apply_to(run_cfg)
    accelerator = select_accelerator("cpu")
    with world(accelerator, ParallelConfig()) as layout:
        model = _build(parts, torch_dtype, accelerator, layout)
        fill_from_hf([model], hf, mapping, progress=progress)

        def artifacts(step_dir: Path) -> None:
            if processor is not None:
                processor.save_pretrained(str(step_dir / "processor"))

        state = {"step": 0, "weights_only": True, "source": str(src)}
        CheckpointManager(dst / "checkpoints").save(0, _WeightsOnly(model), state, to_dict(run_cfg),
                                                    artifacts=artifacts)
    return dst / "checkpoints"


def checkpoint_tensors(step_dir: Path, parts: VLMParts) -> CheckpointTensors:
    """The model tensors of a loong-vlm step directory, to be read one whole tensor at a time (whatever layout
    wrote them), their names and shapes checked against ``parts`` from the checkpoint's metadata."""
    reader = CheckpointTensors(step_dir)
    wanted = native_shapes(parts)
    missing = sorted(set(wanted) - set(reader.meta))
    if missing:
        raise LoongError(f"{step_dir} lacks model tensors {missing[:3]} for its config")
    bad = sorted(k for k, shape in wanted.items() if reader.meta[k][0] != shape)
    if bad:
        raise LoongError(f"{step_dir}: {bad[0]} has shape {reader.meta[bad[0]][0]}, its config implies "
                         f"{wanted[bad[0]]}")
    return reader


def read_native(step_dir: Path, parts: VLMParts) -> dict[str, torch.Tensor]:
    """The whole native model state of a loong-vlm step directory (whole tensors in their saved dtype, whatever
    layout wrote them), checked against ``parts``' names and shapes. (The converter streams instead.)"""
    reader = checkpoint_tensors(step_dir, parts)
    return {k: reader.get(k) for k in native_shapes(parts)}


def loong_to_hf(src: Path, dst: Path, dtype: str = "auto", processor: str | Path | None = None,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = False) -> Path:
    """Export a Loong VLM checkpoint (any layout it was saved at) as an HF folder with its processor
    (``processor``: a processor folder instead of the checkpoint's own), sharded above ``max_shard_bytes``;
    streamed, one native tensor read at a time (module docstring)."""
    step_dir = resolve_checkpoint(src)
    parts = checkpoint_parts(step_dir)
    check_parts(parts, "convert to a Hugging Face folder")
    proc_dir = Path(processor) if processor is not None else step_dir / "processor"
    if not has_processor(proc_dir):
        where = f"--processor {processor}" if processor is not None else f"{step_dir} (no processor/ beside it)"
        raise LoongError(f"{where}: no processor folder; the HF folder's config takes its placeholder token ids "
                         "from the processor's tokenizer: pass --processor DIR")
    proc = load_processor_folder(proc_dir)
    hf_config_of(parts, proc)  # refuse a misfit processor before reading the weights
    reader = checkpoint_tensors(step_dir, parts)
    out_dtype = convert_dtype(dtype, (reader.meta[k][1] for k in native_shapes(parts)), str(step_dir))
    return write_hf_tensors(reader.get, parts, dst, out_dtype, proc, max_shard_bytes=max_shard_bytes,
                            progress=progress)


class _CheckpointAsHF:
    """A checkpoint's tensors under HF names, for :func:`compare_tensors`: asking for an HF tensor reads the
    native tensor it comes from and maps it, keeping that one native tensor's HF tensors until another is asked
    for (so the side is never held whole; its keys come grouped by native tensor)."""

    def __init__(self, reader: CheckpointTensors, mapping: KeyMapping) -> None:
        self.reader, self.mapping = reader, mapping
        self.owner: dict[str, str] = {}
        for key, shape in mapping.shapes.items():  # the HF names, from meta tensors: nothing read
            for name in mapping.to_hf(key, torch.empty(shape, dtype=reader.meta[key][1], device="meta")):
                self.owner[name] = key
        self._key: str | None = None
        self._tensors: dict[str, torch.Tensor] = {}

    def keys(self) -> list[str]:
        return list(self.owner)

    def __contains__(self, key: object) -> bool:
        return key in self.owner

    def get(self, name: str) -> torch.Tensor:
        key = self.owner[name]
        if key != self._key:
            self._key, self._tensors = None, {}  # the previous native tensor goes before the next is read
            self._tensors, self._key = self.mapping.to_hf(key, self.reader.get(key)), key
        return self._tensors[name]


class _InOrder:
    """``source``'s tensors, :meth:`keys` listing ``order``'s names first: the HF folder compared in the
    checkpoint side's order, so each native tensor is read once."""

    def __init__(self, source: TensorSource, order: Iterable[str]) -> None:
        self.source, self.order = source, list(order)

    def keys(self) -> list[str]:
        first = [k for k in self.order if k in self.source]
        placed = set(first)
        return first + [k for k in self.source.keys() if k not in placed]

    def __contains__(self, key: object) -> bool:
        return key in self.source

    def get(self, key: str) -> torch.Tensor:
        return self.source.get(key)


def verify(hf_folder: str | Path, checkpoint: str | Path, into: str, progress: bool = False) -> str:
    """Reread both sides of a conversion and compare every tensor under HF names (the checkpoint's native state
    through :class:`~loong.vlm.hf.KeyMapping`, in the HF folder's own layout); a one-line summary. Tensor by
    tensor: one native tensor's HF tensors and one HF tensor in memory at a time.

    ``into``: the side that was written (``"hf"`` or ``"loong"``); the other side is cast to its dtype and must then
    match bit for bit, with the same names. Raises :class:`~loong.core.checkpoint.safetensors_io.VerifyError` on the
    first tensor that differs.
    """
    from loong.llm.hf_io import HFTensors

    start = time.perf_counter()
    step_dir = resolve_checkpoint(Path(checkpoint))
    parts = checkpoint_parts(step_dir)
    hf = HFTensors(hf_folder)
    # the layout (legacy names, expert form) is read from the names and shapes alone: meta tensors, no data
    layout = layout_of({k: torch.empty(hf.meta(k)[0], dtype=hf.meta(k)[1], device="meta") for k in hf.keys()},
                       parts)
    ours = _CheckpointAsHF(checkpoint_tensors(step_dir, parts), KeyMapping(parts, layout))
    hf_name, ckpt_name = str(hf.folder), str(step_dir)
    sides = ((_InOrder(hf, ours.keys()), ours, hf_name, ckpt_name) if into == "hf"
             else (ours, hf, ckpt_name, hf_name))
    result = compare_tensors(*sides, progress=progress)
    written, source = ("HF", "Loong") if into == "hf" else ("Loong", "HF")
    return verify_summary([result], written, source, start)


def _is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file()


def convert(src: str | Path, dst: str | Path, dtype: str = "auto", processor: str | Path | None = None,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = False, check: bool = False
            ) -> tuple[Path, str | None]:
    """Convert in the direction SRC implies; ``(what was written, the verify summary or None)``; nothing is
    written when SRC is not understood. ``dtype``: ``auto`` (the source's, both ways, as in
    ``loong-llm convert``), ``bf16``, ``fp32`` or ``fp16``; ``processor`` (Loong → HF only): the processor folder to write beside
    the weights; ``max_shard_bytes``: the HF shard size (Loong → HF only); ``check``: reread both sides and
    compare every tensor afterwards (:func:`verify`)."""
    src_p, dst_p = Path(src), Path(dst)
    if dtype != "auto" and dtype not in DTYPES:
        raise LoongError(f"--dtype {dtype}: one of auto, {', '.join(DTYPES)}")
    if not src_p.exists():
        raise LoongError(f"{src} does not exist")
    if _is_hf_folder(src_p):
        if processor is not None:
            raise LoongError(f"--processor applies to a Loong checkpoint; {src} is a Hugging Face folder (its own "
                             "processor is kept)")
        out = hf_to_loong(src_p, dst_p, dtype, progress=progress)
        return out, verify(src_p, out, "loong", progress=progress) if check else None
    try:
        resolve_checkpoint(src_p, verify=False)  # is it a checkpoint at all? (integrity: below)
    except LoongError as exc:
        if "not a Loong checkpoint" not in str(exc):  # a checkpoint, but broken: say how
            raise
        raise LoongError(f"{src} is neither a Hugging Face model folder (no config.json) nor a Loong checkpoint "
                         "(no manifest.json, trainer_state.json or step_* directories)") from None
    out = loong_to_hf(src_p, dst_p, dtype, processor, max_shard_bytes=max_shard_bytes, progress=progress)
    return out, verify(out, src_p, "hf", progress=progress) if check else None


__all__ = ["DTYPES", "SECTIONS", "adopt_resume_checkpoint", "checkpoint_parts", "checkpoint_tensors", "convert",
           "hf_to_loong", "loong_to_hf", "read_native", "verify"]
