"""Typed run schemas and a validator that names the dotted path and the closest valid key."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from loong.core.errors import LoongError, did_you_mean


@dataclass
class ParallelConfig:
    """Parallel layout of one model component. ``dp`` is derived: world / (tp * pp * cp).

    megatron engine: ``tp``, ``pp``, ``vpp``, ``cp``, ``ep``, ``etp``, ``sequence_parallel``.
    fsdp engine: ``fsdp`` (``full``: FSDP2 over every data-parallel rank; ``hybrid``: HSDP, replicas of
    ``dp_shard``-way shards; ``none``: plain DDP), ``dp_replicate`` / ``dp_shard`` (sizes of the mesh's
    ``dp_replicate`` and ``dp_shard`` dims; ``-1``: what the world leaves), ``cp_ulysses`` × ``cp_ring`` = ``cp``
    (context parallelism of full attention: Ulysses all-to-all inside, ring across), ``fsdp_cpu_offload``
    (parameters, gradients and optimiser state in host memory; the optimiser steps on the CPU).
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool = False
    fsdp: Literal["full", "hybrid", "none"] = "full"
    dp_replicate: int = -1
    dp_shard: int = -1
    cp_ulysses: int = 1
    cp_ring: int = 1
    fsdp_cpu_offload: bool = False


@dataclass
class BalanceConfig:
    """Data-parallel load balancing of variable-length samples (``data.balance``).

    ``cost``: ``flops`` (the task's analytic per-sample FLOPs), ``fit`` (start from ``flops``, then
    fit ``a*len**2 + b*len + c`` to the per-rank compute times measured over ``fit_steps`` steps),
    or ``[a, b, c]`` given (``[a, b, c, enc_a, enc_b]`` where samples also run an encoder).
    """

    enabled: bool = False
    cost: str | list[float] = "flops"
    fit_steps: int = 8

    def validate(self, path: str) -> None:
        if isinstance(self.cost, str):
            if self.cost not in ("flops", "fit"):
                raise LoongError(f"{path}.cost: {self.cost!r} is not 'flops', 'fit' or a list [a, b, c]"
                                 f"{did_you_mean(self.cost, ['flops', 'fit'])}")
        elif len(self.cost) not in (3, 5) or any(c < 0 for c in self.cost):
            raise LoongError(f"{path}.cost: expected three non-negative coefficients [a, b, c] "
                             f"(cost = a*len^2 + b*len + c), or five with the encoder's [.., enc_a, enc_b], "
                             f"got {self.cost}")
        if self.fit_steps < 1:
            raise LoongError(f"{path}.fit_steps: must be >= 1, got {self.fit_steps}")


@dataclass
class DataConfig:
    """Where training text comes from. ``path=None`` uses the corpus shipped in the package."""

    path: str | None = None
    format: Literal["auto", "text", "jsonl"] = "auto"
    text_field: str = "text"
    tokenizer: str | None = None
    valid_fraction: float = 0.05
    balance: BalanceConfig = field(default_factory=BalanceConfig)


@dataclass
class TrainConfig:
    """The optimisation schedule, batch shape, cadences and run-level switches."""

    steps: int = 200
    seq_length: int = 128
    global_batch_size: int = 16
    micro_batch_size: int = 4
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    distributed_optimizer: bool = False
    # torch AdamW's implementation (megatron-core's optimizer without Apex/TE): "auto" is the accelerator's
    # choice (the fused kernel on CUDA: no full-size temporaries, one launch per group; foreach elsewhere)
    optimizer_impl: Literal["auto", "foreach", "fused"] = "auto"
    # Megatron-LM's --grad-reduce-in-bf16: gradients accumulate and all-reduce in bf16 (half the fp32 grad buffer:
    # 2 bytes per parameter, and half the DP traffic); the optimiser still steps on fp32 copies. bf16 runs only.
    grad_reduce_in_bf16: bool = False
    # Megatron-LM's --optimizer-cpu-offload: the fp32 master weights and Adam's moments live in (pinned) host memory
    # and the AdamW step runs on the CPU (megatron-core's HybridDeviceOptimizer), freeing 12 bytes per parameter
    # of device memory for a host round trip per step. Needs train.distributed_optimizer=true and an accelerator
    # that can (CUDA); optimizer_offload_fraction < 1 keeps that share of the parameters' state on the device.
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    log_interval: int = 1
    eval_interval: int = 50
    eval_iters: int = 2
    save_interval: int = 0
    save_final: bool = True
    keep_last: int = 2
    async_save: bool = False
    checkpoint_checksums: bool = True
    on_nonfinite: Literal["stop", "skip", "rollback"] = "stop"
    # hooks on every module's gradients that name where a backward first produces NaN/Inf (slow: for debugging)
    nonfinite_probe: bool = False
    resume: str = "auto"
    save_hf: bool = False
    progress: bool = True
    time_limit_s: float = 0.0
    profile_steps: list[int] = field(default_factory=list)
    # fsdp engine: torch.compile each block (graph breaks are printed once, after the first step)
    compile: bool = False
    # fsdp engine: an exponential moving average of the (fp32, sharded) weights, updated after every optimiser step,
    # ema = decay·ema + (1 − decay)·weights (0: off); saved in checkpoints. export_ema: train.save_hf writes the EMA
    ema_decay: float = 0.0
    export_ema: bool = False

    def validate(self, path: str) -> None:
        if not 0.0 <= self.ema_decay < 1.0:
            raise LoongError(f"{path}.ema_decay: 0 (off) or a decay in (0, 1) such as 0.999, got {self.ema_decay}")
        if self.export_ema and self.ema_decay == 0.0:
            raise LoongError(f"{path}.export_ema=true exports the EMA of the weights, but {path}.ema_decay=0 keeps "
                             f"none; set {path}.ema_decay (e.g. 0.999) or drop {path}.export_ema")
        if self.lr < 0 or self.min_lr < 0:
            raise LoongError(f"{path}.lr / {path}.min_lr: learning rates must be >= 0, got lr={self.lr}, "
                             f"min_lr={self.min_lr}")
        if self.min_lr > self.lr:
            raise LoongError(f"{path}.min_lr={self.min_lr} is above {path}.lr={self.lr}: the schedule decays from lr "
                             f"to min_lr; lower {path}.min_lr (e.g. {path}.min_lr={self.lr / 10:g})")


@dataclass
class PrecisionConfig:
    """FP8 execution of the model's linear layers (``precision``); ``train.precision`` stays the
    bf16/fp32 switch of everything else, and FP8 needs it to be bf16.

    ``fp8``: ``off``; ``tensorwise`` / ``rowwise`` / ``blockwise`` (every eligible linear layer in that
    recipe); ``adaptive`` (``fp8_adaptive_recipe`` only on the layers whose measured or tabulated speedup,
    quantisation included, is at least ``fp8_adaptive_threshold``). ``fp8_probe``: on a GPU, time the
    model's GEMM shapes once and cache them (``~/.cache/loong/fp8/<gpu>.json``); ``fp8_table``: a JSON speedup
    table to use instead. ``fp8_exclude``: layer-name globs kept in high precision (the output layer
    always is). See docs/fp8.md.
    """

    fp8: Literal["off", "tensorwise", "rowwise", "blockwise", "adaptive"] = "off"
    fp8_adaptive_threshold: float = 1.1
    fp8_adaptive_recipe: Literal["tensorwise", "rowwise", "blockwise"] = "tensorwise"
    fp8_probe: bool = True
    fp8_table: str | None = None
    fp8_exclude: list[str] = field(default_factory=list)

    def validate(self, path: str) -> None:
        if self.fp8_adaptive_threshold <= 0:
            raise LoongError(f"{path}.fp8_adaptive_threshold: must be > 0 (a speedup factor such as 1.1), "
                             f"got {self.fp8_adaptive_threshold}")
        if not all(isinstance(p, str) and p for p in self.fp8_exclude):
            raise LoongError(f"{path}.fp8_exclude: expected a list of layer-name globs, got {self.fp8_exclude!r}")


@dataclass
class RunConfig:
    """The root of a run's config. Modalities subclass it to type ``model`` with their schema."""

    task: str = "llm.pretrain"
    engine: str = "megatron"
    run_name: str | None = None
    output_dir: str = "outputs"
    model: Any = None
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)

    def validate(self, path: str) -> None:
        if self.precision.fp8 != "off" and self.train.precision == "fp32":
            raise LoongError(f"precision.fp8={self.precision.fp8} needs bf16 training, but train.precision=fp32; "
                             "set train.precision=bf16 (or auto on a GPU) or precision.fp8=off")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp`` (light coercion: int→float), raising LoongError."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except LoongError as exc:
                errors.append(str(exc))
        raise LoongError(errors[0] if errors else f"{path}: invalid value {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            extra = did_you_mean(str(value), [str(c) for c in choices])
            raise LoongError(f"{path}: {value!r} is not one of {list(choices)}{extra}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise LoongError(f"{path}: expected a mapping, got {value!r}")
        return from_dict(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise LoongError(f"{path}: expected a list, got {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise LoongError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise LoongError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise LoongError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise LoongError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise LoongError(f"{path}: expected a string, got {value!r}")
    return value


def from_dict(cls: type, data: dict, path: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys fail with their dotted path and closest key."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in names:
            raise LoongError(f"unknown config key '{dotted}'{did_you_mean(str(key), names)}")
        kwargs[key] = _coerce(value, hints[key], dotted)
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if callable(check):
        check(path or cls.__name__)
    return obj


def to_dict(obj: Any) -> Any:
    """Dataclass tree → plain dict (for saving the resolved config)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def schema_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key a schema accepts (used to suggest the closest key for a bad override)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}{f.name}"
        out.append(dotted)
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(schema_keys(tp, dotted + "."))
    return out
