"""``loong-diffusion convert SRC DST``: a diffusers ``WanTransformer3DModel`` folder ⇄ a Loong checkpoint; the
direction comes from SRC.

- A diffusers folder becomes a weights-only Loong checkpoint ``DST/checkpoints/step_00000000`` (torch DCP, the
  fsdp engine's format: any layout loads it). ``loong-diffusion train train.resume=DST`` starts a fresh run from
  its weights, with its model config (the closest preset plus the fields that differ); it is the same start as
  ``model.init_from_diffusers=SRC``.
- A Loong checkpoint (a step directory, a run's ``checkpoints`` folder or the run folder: its newest verified
  step) becomes a diffusers folder ``DST`` that ``WanTransformer3DModel.from_pretrained`` loads (a run of both
  Wan 2.2 A14B experts: ``DST/transformer`` and ``DST/transformer_2``, as a diffusers pipeline holds them);
  ``ema=True`` writes the moving averages of the weights (``train.ema_decay``) instead of the weights.

Both directions keep the stored dtype unless told otherwise, so diffusers → Loong → diffusers gives back the
same tensors and ``config.json``, bit for bit. The mapping is ``models.wan.mapping``'s; nothing is unpickled.
Diffusers folders are read single-file or sharded and written in shards of at most ``max_shard_bytes`` with
diffusers' index (the core's :mod:`~loong.core.checkpoint.safetensors_io`); :func:`verify` rereads both sides
and compares every tensor bit for bit. Loong → diffusers streams (one checkpoint tensor in memory at a time, then
one shard); diffusers → Loong reads one tensor group at a time but holds the Loong state once (DCP's save takes
the whole state dict).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from loong.core.checkpoint import CheckpointManager, read_config, read_state, resolve_checkpoint
from loong.core.checkpoint.safetensors_io import (
    LazyTensors,
    SafetensorsFolder,
    ShardWriter,
    compare_tensors,
    progress_bar,
    verify_summary,
)
from loong.core.config.schema import from_dict, to_dict
from loong.core.engines.fsdp.checkpoint import EMA_KEY, check_same_model
from loong.core.errors import LoongError
from loong.diffusion.experts import EXPERTS
from loong.diffusion.models.wan import WanConfig, WanTransformer, config_from_diffusers, save_diffusers
from loong.diffusion.models.wan.config import PRESETS
from loong.diffusion.models.wan.mapping import (
    CONFIG_NAME,
    IGNORED,
    KEEP_FP32,
    MAX_SHARD_BYTES,
    WEIGHTS_STEM,
    check_diffusers_weights,
    config_to_diffusers,
    from_diffusers,
    open_diffusers_folder,
    read_diffusers_folder,
    to_diffusers,
)
from loong.diffusion.schema import WAN_FIELDS, DiffusionRunConfig, WanModelConfig

#: the Wan model's place in the trained module (``task.ShardPrediction.wan``): the prefix of its checkpoint keys
MODEL_PREFIX = "wan."
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
#: where a diffusers Wan 2.2 A14B pipeline keeps each expert
PIPELINE_FOLDERS = {"high_noise": "transformer", "low_noise": "transformer_2"}
#: pipeline-level Wan settings a diffusers pipeline folder keeps in ``model_index.json`` beside ``transformer/``
_PIPELINE_INDEX = "model_index.json"


def model_config_for(wan: WanConfig) -> WanModelConfig:
    """The run's ``model`` section for ``wan``: the preset with the fewest differing fields, those as overrides."""
    def differing(preset: WanConfig) -> list[str]:
        return [name for name in WAN_FIELDS if getattr(preset, name) != getattr(wan, name)]

    name = min(PRESETS, key=lambda p: len(differing(PRESETS[p])))
    overrides = {k: (list(v) if isinstance(v, tuple) else v) for k in differing(PRESETS[name])
                 for v in [getattr(wan, k)]}
    model = WanModelConfig(preset=name, **overrides)
    assert model.wan() == wan  # the preset plus its overrides rebuild the shape exactly
    return model


def is_diffusers_folder(path: Path) -> bool:
    """Whether ``path`` holds a diffusers model's ``config.json``."""
    return (path / CONFIG_NAME).is_file()


def _pipeline_fields(folder: Path) -> dict[str, Any]:
    """``expand_timesteps`` (Wan 2.2 TI2V) from the pipeline's ``model_index.json`` when ``folder`` is a pipeline's
    ``transformer/``: diffusers keeps it there, not in the transformer's config."""
    index = folder.resolve().parent / _PIPELINE_INDEX
    if not index.is_file():
        return {}
    value = json.loads(index.read_text()).get("expand_timesteps")
    return {"expand_timesteps": bool(value)} if value is not None else {}


class _WeightsOnly:
    """The slice of an engine the checkpoint manager needs: the model's tensors under the trained module's keys."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def save(self, directory: Path) -> None:
        dcp.save({"model": self.state}, checkpoint_id=str(directory))


def diffusers_to_loong(src: Path, dst: Path, dtype: str = "auto") -> Path:
    """Write the diffusers transformer folder ``src`` as a weights-only Loong checkpoint under ``dst/checkpoints``;
    returns the step directory."""
    raw, folder = open_diffusers_folder(src)
    try:
        wan = config_from_diffusers(raw, **_pipeline_fields(src))
    except LoongError as exc:  # the config reader knows fields, not the file
        raise LoongError(f"{src / CONFIG_NAME}: {exc}") from None
    target = DTYPES.get(dtype)
    lazy = LazyTensors(folder, cast=lambda t: t.to(target) if target is not None and t.is_floating_point() else t)
    check_diffusers_weights(src, wan, lazy.meta())  # names, shapes, dtypes from the headers: before any read
    # the source is read one tensor (or one fused group: qkv) at a time and cast as it is read (a cast of the
    # concatenation is the concatenation of the casts, bit for bit): only the Loong state is held, once, as
    # torch DCP's save needs the whole state dict
    model = {MODEL_PREFIX + k: v.contiguous() for k, v in from_diffusers(lazy).items()}
    run_cfg = DiffusionRunConfig(model=model_config_for(wan), run_name=dst.name, output_dir=str(dst.parent))
    trainer_state = {"step": 0, "weights_only": True, "source": str(src)}
    return CheckpointManager(dst / "checkpoints").save(0, _WeightsOnly(model), trainer_state, to_dict(run_cfg))


@dataclasses.dataclass
class Checkpoint:
    """What :func:`read_checkpoint` reads: the step directory, its resolved run config (as saved, a plain dict),
    the model's shape and the Wan state dict of each module it trained: ``{"": state}`` for one model,
    ``{"high_noise": ..., "low_noise": ...}`` for both Wan 2.2 A14B experts (``model.expert=both``)."""

    step_dir: Path
    config: dict[str, Any]
    wan: WanConfig
    states: dict[str, dict[str, torch.Tensor]]

    @property
    def step(self) -> int:
        """The optimiser steps the checkpoint was taken after."""
        return int(read_state(self.step_dir)["step"])

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """The one model's state dict (a :class:`LoongError` for a checkpoint of both experts)."""
        if "" not in self.states:
            raise LoongError(f"{self.step_dir} holds both Wan 2.2 A14B experts ({', '.join(self.states)})")
        return self.states[""]


def _prefix(expert: str) -> str:
    """The checkpoint key prefix of one trained module's Wan weights (``task.ShardPrediction`` / ``ExpertPair``)."""
    return f"{expert}.{MODEL_PREFIX}" if expert else MODEL_PREFIX


def split_modules(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """A trained module's state dict (``wan.*``, or ``high_noise.wan.*`` and ``low_noise.wan.*`` for both A14B
    experts) as the Wan state dict of each module, keyed as :attr:`Checkpoint.states`."""
    experts = EXPERTS if any(k.startswith(_prefix(EXPERTS[0])) for k in state) else ("",)
    out = {e: {k.removeprefix(_prefix(e)): v for k, v in state.items() if k.startswith(_prefix(e))} for e in experts}
    stray = sorted(set(state) - {_prefix(e) + k for e, part in out.items() for k in part})
    if stray:
        raise LoongError(f"{stray[0]!r} is not a weight of the trained Wan module (wan.* or <expert>.wan.*)")
    return out


def write_diffusers(states: dict[str, dict[str, torch.Tensor]], wan: WanConfig, dst: str | Path,
                    max_shard_bytes: int = MAX_SHARD_BYTES, progress: bool = False) -> Path:
    """Write :attr:`Checkpoint.states`-like Wan state dicts as diffusers folders: one model to ``dst``, both A14B
    experts to ``dst/transformer`` and ``dst/transformer_2``; each sharded with diffusers' index above
    ``max_shard_bytes``. Returns ``dst``."""
    dst = Path(dst)
    with progress_bar(progress, "convert") as bar:
        task = bar.add_task("convert", total=sum(v.numel() for s in states.values() for v in s.values()), name="")
        for expert, state in states.items():
            save_diffusers(state, wan, dst / PIPELINE_FOLDERS[expert] if expert else dst,
                           max_shard_bytes=max_shard_bytes, progress=(bar, task))
    return dst


@dataclasses.dataclass
class _Plan:
    """What a checkpoint holds, from its metadata alone: the step directory, config, shape, the trained modules
    (``("",)`` or both experts), every Wan key's meta tensor under the trained module's names, and the DCP key each
    is read from (``model.<k>``, or ``ema.<k>`` for an averaged weight when the moving averages are asked for)."""

    step_dir: Path
    config: dict[str, Any]
    wan: WanConfig
    experts: tuple[str, ...]
    shapes: dict[str, torch.Tensor]
    source: dict[str, str]
    dtypes: dict[str, torch.dtype]


def _plan(path: str | Path, ema: bool) -> _Plan:
    step_dir = resolve_checkpoint(path)
    config = read_config(step_dir)
    try:
        # only the model's section is parsed: the data and train keys of the run (its data paths, say) need not
        # be valid on this machine; the start folder the run was initialised from is history
        model = from_dict(WanModelConfig, {**config.get("model", {}), "init_from_diffusers": None}, "model")
    except LoongError as exc:
        raise LoongError(f"{step_dir} is not a loong-diffusion checkpoint ({exc})") from None
    wan = model.wan()
    meta = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    pair = any(k.startswith(f"model.{_prefix(EXPERTS[0])}") for k in meta)
    experts = EXPERTS if pair else ("",)
    with torch.device("meta"):
        one = WanTransformer(wan).state_dict()
    shapes = {_prefix(e) + k: v for e in experts for k, v in one.items()}
    check_same_model(step_dir, shapes, allow_missing=False)
    source = {k: f"model.{k}" for k in shapes}
    if ema:
        averaged = {k for k in shapes if f"{EMA_KEY}.{k}" in meta}
        if not averaged:
            decay = config.get("train", {}).get("ema_decay", 0.0)
            raise LoongError(f"{step_dir} holds no moving averages of the weights (its run had train.ema_decay="
                             f"{decay}); drop --ema to use the weights")
        source.update({k: f"{EMA_KEY}.{k}" for k in averaged})  # a frozen parameter has no average: its own value
    dtypes = {k: meta[d].properties.dtype for k, d in source.items()}
    return _Plan(step_dir, config, wan, experts, shapes, source, dtypes)


def _read(plan: _Plan, keys: list[str]) -> dict[str, torch.Tensor]:
    """The whole tensors of ``keys`` (trained-module names) in their saved dtype; only their chunks are read."""
    out = {k: torch.empty(plan.shapes[k].shape, dtype=plan.dtypes[k]) for k in keys}
    nested: dict[str, dict[str, torch.Tensor]] = {}
    for k, t in out.items():
        group, name = plan.source[k].split(".", 1)
        nested.setdefault(group, {})[name] = t
    dcp.load(nested, checkpoint_id=str(plan.step_dir))  # in place, into the tensors above
    return out


def read_checkpoint(path: str | Path, ema: bool = False) -> Checkpoint:
    """A Loong checkpoint's Wan weights (whole tensors in their saved dtype, on the host; ``ema``: the moving
    averages of the weights instead) and config. Reads only the model's tensors (no optimiser state) and needs no
    process group. (:func:`loong_to_diffusers` streams instead: one tensor in memory at a time.)"""
    plan = _plan(path, ema)
    return Checkpoint(plan.step_dir, plan.config, plan.wan, split_modules(_read(plan, list(plan.shapes))))


def load_model(state: dict[str, torch.Tensor], wan: WanConfig, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None, **model_kwargs: Any) -> WanTransformer:
    """A :class:`WanTransformer` holding ``state`` (e.g. from :func:`read_checkpoint`); a ``dtype`` below float32
    keeps diffusers' float32 parameters (:data:`~loong.diffusion.models.wan.mapping.KEEP_FP32`) in float32, as
    ``load_diffusers`` does. ``model_kwargs``: the model's context-parallel groups and capabilities."""
    keep = dtype is not None and torch.finfo(dtype).bits < 32
    with torch.device("meta"):
        model = WanTransformer(wan, **model_kwargs)
    cast = {k: v.to(device=device, dtype=torch.float32 if keep and KEEP_FP32.search(k) else dtype)
            for k, v in state.items()}
    model.load_state_dict(cast, strict=True, assign=True)
    return model


def loong_to_diffusers(src: Path, dst: Path, dtype: str = "auto", ema: bool = False,
                       max_shard_bytes: int = MAX_SHARD_BYTES, progress: bool = False) -> Path:
    """Write a Loong checkpoint's Wan weights (or, ``ema``, their moving averages) as a diffusers folder ``dst``;
    a checkpoint of both A14B experts as ``dst/transformer`` (high-noise) and ``dst/transformer_2`` (low-noise),
    the folders of a diffusers Wan 2.2 pipeline. Streamed: one checkpoint tensor is read, cast, split (fused qkv)
    and handed to the shard writer at a time, so memory stays near one tensor plus one shard being filled."""
    plan = _plan(src, ema)
    target = DTYPES.get(dtype)
    dst = Path(dst)
    with progress_bar(progress, "convert") as bar:
        task = bar.add_task("convert", total=sum(v.numel() for v in plan.shapes.values()), name="")
        for expert in plan.experts:
            folder = dst / PIPELINE_FOLDERS[expert] if expert else dst
            folder.mkdir(parents=True, exist_ok=True)
            writer = ShardWriter(folder, max_shard_bytes, stem=WEIGHTS_STEM)
            for key in (k for k in plan.shapes if k.startswith(_prefix(expert))):
                (tensor,) = _read(plan, [key]).values()
                if target is not None and tensor.is_floating_point():
                    tensor = tensor.to(target)
                for name, piece in to_diffusers({key.removeprefix(_prefix(expert)): tensor}).items():
                    bar.update(task, name=name)
                    writer.add(name, piece)
                    bar.advance(task, piece.numel())
                del tensor
            writer.close()
            (folder / CONFIG_NAME).write_text(json.dumps(config_to_diffusers(plan.wan), indent=2, sort_keys=True)
                                              + "\n")
    return dst


def _folder(path: Path) -> SafetensorsFolder:
    return SafetensorsFolder(path, stem=WEIGHTS_STEM, what="diffusers folder")


def verify(diffusers: str | Path, checkpoint: str | Path, into: str, ema: bool = False, progress: bool = False
           ) -> str:
    """Reread both sides of a conversion and compare every tensor under diffusers' names (the checkpoint's Wan
    weights through :func:`~loong.diffusion.models.wan.mapping.to_diffusers`); a one-line summary.

    ``into``: the side that was written (``"diffusers"`` or ``"loong"``); the other side is cast to its dtype and
    must then match bit for bit, with the same names (diffusers' ignored keys aside). ``ema``: the checkpoint side
    is its moving averages. Raises :class:`~loong.core.checkpoint.safetensors_io.VerifyError` on the first
    tensor that differs.
    """
    start = time.perf_counter()
    ckpt = read_checkpoint(checkpoint, ema=ema)
    root = Path(diffusers)
    results = []
    for expert, state in ckpt.states.items():
        folder = root / PIPELINE_FOLDERS[expert] if expert else root
        hf, native = _folder(folder), to_diffusers(state)
        hf_name, ckpt_name = str(folder), str(ckpt.step_dir) + (f" ({expert})" if expert else "")
        sides = (hf, native, hf_name, ckpt_name) if into == "diffusers" else (native, hf, ckpt_name, hf_name)
        results.append(compare_tensors(*sides, ignore=lambda k: bool(IGNORED.search(k)), progress=progress))
    written, source = ("diffusers", "Loong") if into == "diffusers" else ("Loong", "diffusers")
    return verify_summary(results, written, source, start)


def convert(src: str | Path, dst: str | Path, dtype: str = "auto", ema: bool = False,
            max_shard_bytes: int = MAX_SHARD_BYTES, progress: bool = False, check: bool = False
            ) -> tuple[Path, str | None]:
    """Convert in the direction ``src`` implies; ``(what was written, the verify summary or None)``. Nothing is
    written when ``src`` is not understood. ``ema``: export a checkpoint's moving averages (Loong → diffusers
    only); ``max_shard_bytes``: the diffusers shard size (Loong → diffusers only); ``check``: reread both sides
    and compare every tensor afterwards (:func:`verify`)."""
    src_p, dst_p = Path(src), Path(dst)
    if not src_p.exists():
        raise LoongError(f"{src} does not exist")
    if dtype != "auto" and dtype not in DTYPES:
        raise LoongError(f"--dtype {dtype}: one of auto, {', '.join(DTYPES)}")
    if is_diffusers_folder(src_p) or (src_p / "transformer" / CONFIG_NAME).is_file():
        if ema:
            raise LoongError(f"--ema exports a Loong checkpoint's moving averages; {src} is a diffusers folder")
        if not is_diffusers_folder(src_p):  # a whole pipeline: read_diffusers_folder says to pass transformer/
            read_diffusers_folder(src_p)
        out = diffusers_to_loong(src_p, dst_p, dtype)
        return out, verify(src_p, out, "loong", progress=progress) if check else None
    try:
        resolve_checkpoint(src_p, verify=False)  # is it a checkpoint at all? (integrity: when read)
    except LoongError as exc:
        if "not a Loong checkpoint" not in str(exc):  # a checkpoint, but broken: say how
            raise
        raise LoongError(f"{src} is neither a diffusers transformer folder (no {CONFIG_NAME}) nor a Loong checkpoint "
                         "(no manifest.json, trainer_state.json or step_* directories)") from None
    out = loong_to_diffusers(src_p, dst_p, dtype, ema=ema, max_shard_bytes=max_shard_bytes, progress=progress)
    return out, verify(out, src_p, "diffusers", ema=ema, progress=progress) if check else None


__all__ = ["DTYPES", "MODEL_PREFIX", "Checkpoint", "convert", "diffusers_to_loong", "is_diffusers_folder",
           "load_model", "loong_to_diffusers", "model_config_for", "read_checkpoint", "split_modules", "verify",
           "write_diffusers"]
