"""``loong-llm convert SRC DST``: Hugging Face folder ⇄ Loong checkpoint; direction from SRC.

An HF folder becomes a weights-only Loong checkpoint (layout-independent: train it at any TP/PP with
``train.resume=DST``); a Loong checkpoint becomes an HF folder that ``from_pretrained`` loads.

Both directions stream one native tensor at a time, for every family (DeepSeek-V3/V3.2 included) and with
``--merge-lora`` (each tensor's adapters are read and merged with it); see docs/checkpoints.md for the memory bound. HF side: ``safe_open`` reads one tensor at a time from ``model.safetensors`` or the shards of
``model.safetensors.index.json``, and :class:`~loong.llm.hf_io.ShardWriter` writes shards of at most
``max_shard_size`` as they fill. Loong side: tensors are read one at a time from the torch-DCP files megatron-core
writes; writing needs megatron-core's own save of a built model (its ``_extra_state`` objects and common state go
with the tensors), so HF → Loong holds the model once, in the checkpoint's dtype. ``verify`` rereads both sides and
compares every tensor bit for bit.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from loong.core.checkpoint import CheckpointManager, resolve_checkpoint
from loong.core.checkpoint.safetensors_io import VerifyError, convert_dtype, first_difference, progress_bar
from loong.core.errors import LoongError
from loong.llm.hf_io import DEFAULT_MAX_SHARD_BYTES, HFTensors, ShardWriter, write_hf_metadata
from loong.llm.models.config import DenseModelConfig
from loong.llm.models.hf_mapping import (
    extra_hf_keys,
    family_by_name,
    hf_to_native_key,
    ignored_hf_key,
    is_stacked,
    native_shapes,
    native_to_hf_key,
)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class _WeightsOnly:
    """The slice of an engine the checkpoint manager needs, for a model without an optimiser."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def save(self, directory: Path) -> None:
        from megatron.core import dist_checkpointing

        dist_checkpointing.save({"model": self.model.sharded_state_dict()}, str(directory))


class CheckpointTensors:
    """The model tensors of a Loong step directory (megatron-core's torch-DCP files), read one whole tensor at a
    time: only the chunks of the asked-for tensor are read, whatever TP/PP/EP layout wrote them."""

    def __init__(self, step_dir: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.step_dir = step_dir
        try:
            md = FileSystemReader(str(step_dir)).read_metadata()
        except Exception as exc:  # noqa: BLE001 (torch raises several kinds for a missing/truncated .metadata)
            raise LoongError(f"{step_dir}: cannot read the checkpoint's tensor metadata ({exc})") from None
        self.meta = {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
                     if isinstance(v, TensorStorageMetadata)}

    def get(self, key: str) -> torch.Tensor:
        """One whole tensor, in its saved dtype."""
        from torch.distributed.checkpoint import FileSystemReader, load
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        shape, dtype = self.meta[key]
        out = torch.empty(shape, dtype=dtype)
        load({key: out}, storage_reader=FileSystemReader(str(self.step_dir)),
             planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        return out


def _hf_taker(hf: HFTensors, used: set[str], meta: bool = False) -> Callable[[str], torch.Tensor]:
    """``take(name)`` for :func:`hf_to_native_key`: the tensor (or a meta tensor of its shape: a dry run that
    checks names and shapes before anything heavy), remembering which were used."""

    def take(key: str) -> torch.Tensor:
        if key not in hf:
            raise LoongError(f"{hf.folder}: Hugging Face checkpoint has no tensor {key}")
        used.add(key)
        if meta:
            shape, dtype = hf.meta(key)
            if not dtype.is_floating_point:  # an integer tensor would be cast silently into garbage weights
                raise LoongError(f"{hf.folder}: {key} is {dtype}; model weights must be floating point")
            return torch.empty(shape, dtype=dtype, device="meta")
        return hf.get(key)

    return take


def _check_hf(hf: HFTensors, cfg: DenseModelConfig) -> None:
    """Every native tensor can be built from ``hf`` with the config's shapes, and nothing is left over."""
    used: set[str] = set()
    take = _hf_taker(hf, used, meta=True)
    for key, shape in native_shapes(cfg).items():
        try:
            got = tuple(hf_to_native_key(key, take, cfg).shape)
        except LoongError as exc:  # the mapping's own errors (per-layer shapes that differ) name no folder
            where = "" if str(exc).startswith(f"{hf.folder}:") else f"{hf.folder}: "
            raise LoongError(f"{where}{exc}") from None
        if got != shape:
            raise LoongError(f"{hf.folder}: {key} has shape {got} from the Hugging Face tensors, the config "
                             f"implies {shape}")
    try:
        extra_hf_keys(hf.keys(), used, cfg)
    except LoongError as exc:  # name the folder, as the other checks do
        raise LoongError(f"{hf.folder}: {exc}") from None


def _fill(model: torch.nn.Module, hf: HFTensors, cfg: DenseModelConfig, progress: bool) -> None:
    """Copy the HF tensors into the model's parameters one layer slice of one native tensor at a time (a stacked
    native tensor is never assembled: memory above the model is about one layer's tensor, or the embedding)."""
    from loong.core.engines.megatron.state import load_state_by_key

    shapes = native_shapes(cfg)
    take = _hf_taker(hf, set())
    with progress_bar(progress, "convert") as bar:
        task = bar.add_task("convert", total=sum(math.prod(s) for s in shapes.values()), name="")
        load_state_by_key([model], shapes, lambda key, layer: hf_to_native_key(key, take, cfg, layer=layer),
                          is_stacked, progress=(bar, task))


def hf_to_loong(src: Path, dst: Path, dtype: str = "auto", progress: bool = False) -> Path:
    """Import an HF folder as a weights-only Loong checkpoint under ``dst/checkpoints``.

    ``dtype`` ``auto`` keeps the HF tensors' dtype. The model is built once in that dtype (megatron-core writes the
    checkpoint from it) and filled one native tensor at a time from the lazily read HF tensors.
    """
    from loong.core.accelerators import select_accelerator
    from loong.core.config.schema import ParallelConfig, to_dict
    from loong.core.engines.megatron.layout import init_distributed, shutdown_distributed
    from loong.llm.hf import model_config_from_hf
    from loong.llm.models.build import build_gpt_model, transformer_config
    from loong.llm.schema import LLMRunConfig

    model_cfg = model_config_from_hf(src)
    hf = HFTensors(src)
    _check_hf(hf, model_cfg)  # names and shapes from the headers: fail before building anything
    torch_dtype = convert_dtype(dtype, [hf.meta(k)[1] for k in hf.keys()], str(src))
    accelerator = select_accelerator("cpu")
    with accelerator.activate():
        layout = init_distributed(accelerator, ParallelConfig())
        try:
            # no random initialisation: every weight is overwritten from the HF folder
            overrides = {**accelerator.megatron_config_overrides(), "perform_initialization": False}
            config = transformer_config(model_cfg, ParallelConfig(), torch_dtype, overrides)
            model = build_gpt_model(model_cfg, config, accelerator.capabilities(), True, True,
                                    layout.pg_collection)
            _fill(model, hf, model_cfg, progress)
            run_cfg = LLMRunConfig(model=model_cfg, run_name=dst.name, output_dir=str(dst.parent))

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
            del model
        finally:
            shutdown_distributed()
    return dst / "checkpoints"


def _checkpoint_native(step_dir: Path, cfg: DenseModelConfig, merge_lora: bool
                       ) -> tuple[list[str], Callable[[str], torch.Tensor]]:
    """(native keys, ``get(key)``) of a checkpoint, each tensor read alone from the DCP files when asked for; with
    LoRA adapters (``merge_lora``), ``get`` reads a weight's adapters with it and returns ``W + alpha/rank·B@A``."""
    from loong.llm.lora import A_SUFFIX, B_SUFFIX, is_adapter_key
    from loong.llm.lora import merge_lora as merge

    wanted = native_shapes(cfg)
    reader = CheckpointTensors(step_dir)
    adapters = [k for k in reader.meta if is_adapter_key(k) and not k.startswith("optimizer.")]
    if adapters and not merge_lora:
        raise LoongError(f"{step_dir} is a LoRA checkpoint ({len(adapters)} adapter tensors, model.lora.rank="
                         f"{cfg.lora.rank}); pass --merge-lora to merge the adapters into the Hugging Face weights")
    # weight key -> its (A, B) keys; a lone adapter or one of no model weight is refused before anything is written
    adapted: dict[str, tuple[str, str]] = {}
    for key_a in (k for k in adapters if k.endswith(A_SUFFIX)):
        stem = key_a[: -len(A_SUFFIX)]
        key_b, key_w = stem + B_SUFFIX, stem + ".weight"
        if key_b not in reader.meta or key_w not in wanted:
            raise LoongError(f"{step_dir}: {key_a} has no matching {key_b if key_b not in reader.meta else key_w} "
                             "to merge into")
        adapted[key_w] = (key_a, key_b)
    lone = sorted(k for k in adapters if k.endswith(B_SUFFIX) and k[: -len(B_SUFFIX)] + ".weight" not in adapted)
    if lone:
        raise LoongError(f"{step_dir}: {lone[0]} has no matching {lone[0][: -len(B_SUFFIX)]}{A_SUFFIX} to merge")
    missing = sorted(set(wanted) - set(reader.meta))
    if missing:
        raise LoongError(f"{step_dir} lacks model tensors {missing[:3]} for its config")
    for key, shape in wanted.items():
        if reader.meta[key][0] != shape:
            raise LoongError(f"{step_dir}: {key} has shape {reader.meta[key][0]}, its config implies {shape}")

    def get(key: str) -> torch.Tensor:
        if key not in adapted:
            return reader.get(key)
        a, b = adapted[key]
        w, ta, tb = reader.get(key), reader.get(a), reader.get(b)
        try:
            if is_stacked(key) and w.shape[:1] == ta.shape[:1] == tb.shape[:1]:
                # one layer at a time, into the tensor just read: the merge's fp32 temporaries stay one layer's
                for i in range(w.shape[0]):
                    w[i] = merge({key: w[i], a: ta[i], b: tb[i]}, cfg.lora)[key]
                return w
            return merge({key: w, a: ta, b: tb}, cfg.lora)[key]
        except LoongError as exc:  # the shapes do not fit: name the checkpoint
            raise LoongError(f"{step_dir}: {exc}") from None

    return list(wanted), get


def _hf_tensors_of(keys: list[str], get: Callable[[str], torch.Tensor],
                   cfg: DenseModelConfig) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(native key, HF name, HF tensor) in order, one native tensor in memory at a time."""
    for key in keys:
        for name, tensor in native_to_hf_key(key, get(key), cfg).items():
            yield key, name, tensor


def loong_to_hf(src: Path, dst: Path, dtype: str = "auto", merge_lora: bool = False,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = False) -> Path:
    """Export a Loong checkpoint (any layout it was saved at) as an HF folder, sharded above ``max_shard_bytes``.

    A checkpoint with LoRA adapters needs ``merge_lora=True`` (``--merge-lora``): the adapters are
    merged into the base weights (``W + alpha/rank·B@A``); without it nothing is written.
    """
    from loong.llm.checkpoint_init import checkpoint_model_config

    step_dir = resolve_checkpoint(src)
    cfg = checkpoint_model_config(step_dir, key=None)
    keys, get = _checkpoint_native(step_dir, cfg, merge_lora)
    saved = CheckpointTensors(step_dir).meta[keys[0]][1]
    out_dtype = convert_dtype(dtype, [saved], str(step_dir))
    writer = ShardWriter(dst, max_shard_bytes)
    total = sum(math.prod(s) for s in native_shapes(cfg).values())
    with progress_bar(progress, "convert") as bar:
        task = bar.add_task("convert", total=total, name="")
        for _, name, tensor in _hf_tensors_of(keys, get, cfg):
            bar.update(task, name=name)
            writer.add(name, tensor.to(out_dtype))
            bar.advance(task, tensor.numel())
    writer.close()
    tokenizer = step_dir / "tokenizer"
    family = family_by_name(cfg.family)
    return write_hf_metadata(dst, family.hf_config_dict(cfg, _DTYPE_NAMES[out_dtype]),
                             tokenizer_dir=tokenizer if tokenizer.is_dir() else None)


def verify(hf_folder: str | Path, checkpoint: str | Path, into: str, merge_lora: bool = False,
           progress: bool = False) -> str:
    """Reread both sides of a conversion and compare every tensor; a one-line summary.

    ``into`` is the side that was written (``"hf"`` or ``"loong"``): the other side is cast to its dtype (the
    ``--dtype`` rule) and must then match bit for bit. Names must match too: every HF tensor the checkpoint implies
    exists and there is no other. Raises :class:`VerifyError` naming the first tensor that differs.
    """
    start = time.perf_counter()
    hf = HFTensors(hf_folder)
    step_dir = resolve_checkpoint(Path(checkpoint))
    from loong.llm.checkpoint_init import checkpoint_model_config

    cfg = checkpoint_model_config(step_dir, key=None)
    keys, get = _checkpoint_native(step_dir, cfg, merge_lora)
    seen: set[str] = set()
    count = numel = 0
    dtypes: set[tuple[str, str]] = set()
    with progress_bar(progress, "verify") as bar:
        task = bar.add_task("verify", total=sum(math.prod(s) for s in native_shapes(cfg).values()), name="")
        for native_key, name, ours in _hf_tensors_of(keys, get, cfg):
            bar.update(task, name=name)
            where = f"{name} (native {native_key})"
            if name not in hf:
                raise VerifyError(f"verify: {hf.folder} has no tensor {where}")
            theirs = hf.get(name)
            seen.add(name)
            if tuple(theirs.shape) != tuple(ours.shape):
                raise VerifyError(f"verify: {where} in {hf.folder / hf.file_of(name)} has shape "
                                  f"{tuple(theirs.shape)}, the checkpoint's is {tuple(ours.shape)}")
            dtypes.add((str(theirs.dtype).removeprefix("torch."), str(ours.dtype).removeprefix("torch.")))
            if into == "hf":
                ours = ours.to(theirs.dtype)
            else:
                theirs = theirs.to(ours.dtype)
            a, b = theirs.contiguous(), ours.contiguous()
            if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                raise VerifyError(f"verify: {where} differs between {hf.folder / hf.file_of(name)} and {step_dir}: "
                                  f"{first_difference(a, b)}")
            count += 1
            numel += ours.numel()
            bar.advance(task, ours.numel())
    extra = sorted(k for k in hf.keys() if k not in seen and not ignored_hf_key(k)
                   and not (cfg.tie_word_embeddings and k == "lm_head.weight"))
    if extra:
        raise VerifyError(f"verify: {hf.folder} has {len(extra)} tensors the checkpoint does not, e.g. {extra[:3]}")
    kinds = ", ".join(f"HF {h} / Loong {n}" for h, n in sorted(dtypes))
    return (f"verify: {count} tensors, {numel:,} parameters match bit for bit ({kinds}) "
            f"in {time.perf_counter() - start:.1f} s")


def _is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file()


def convert(src: str | Path, dst: str | Path, dtype: str = "auto", merge_lora: bool = False,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = False,
            check: bool = False) -> tuple[Path, str | None]:
    """Convert in the direction SRC implies; ``(what was written, the verify summary or None)``.

    Nothing is written when SRC is not understood. ``merge_lora``: merge a LoRA checkpoint's adapters into the
    written HF weights (Loong → HF only). ``max_shard_bytes``: the HF shard size (Loong → HF only). ``check``:
    reread both sides and compare every tensor afterwards (:func:`verify`).
    """
    src_p, dst_p = Path(src), Path(dst)
    if not src_p.exists():
        raise LoongError(f"{src} does not exist")
    if _is_hf_folder(src_p):
        if merge_lora:
            raise LoongError(f"--merge-lora applies to a Loong checkpoint; {src} is a Hugging Face folder")
        out = hf_to_loong(src_p, dst_p, dtype, progress=progress)
        return out, verify(src_p, out, "loong", progress=progress) if check else None
    try:
        resolve_checkpoint(src_p, verify=False)  # is it a checkpoint at all? (integrity: below)
    except LoongError as exc:
        if "not a Loong checkpoint" not in str(exc):  # a checkpoint, but broken: say how
            raise
        raise LoongError(
            f"{src} is neither a Hugging Face model folder (no config.json) nor a Loong checkpoint "
            "(no manifest.json, trainer_state.json or step_* directories)"
        ) from None
    out = loong_to_hf(src_p, dst_p, dtype, merge_lora=merge_lora, max_shard_bytes=max_shard_bytes, progress=progress)
    return out, verify(out, src_p, "hf", merge_lora=merge_lora, progress=progress) if check else None
