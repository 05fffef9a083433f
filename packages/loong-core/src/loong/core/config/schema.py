"""Typed run schemas and a validator that names the dotted path, the value and what is allowed.

Every key is checked in one mechanism, :func:`from_dict`, from its field's annotation:

- the type (``int``, ``float``, ``bool``, ``str``, lists, nested schemas, ``X | None``); every ``float`` must be
  finite (no NaN or Inf anywhere);
- ``Literal[...]``: one of the choices (with the closest one suggested);
- ``Annotated[T, Check(...), ...]`` (:mod:`loong.core.config.checks`): bounds (``Check(ge=1)``; the aliases
  ``PositiveInt``, ``NonNegativeInt``, ``PositiveFloat``, ``NonNegativeFloat``, ``Probability``), values allowed
  besides them (``Check(ge=1, also=(-1,))``), non-empty strings and lists, and paths that must exist
  (``Check(path="dir")``, checked by :func:`~loong.core.config.checks.check_paths` when a run starts, not when a
  saved config is read back);
- :data:`~loong.core.config.checks.KEEPS_RUN` in the annotation marks a key that does not change what is trained
  (cadences, where to write, what to do on a failure): a rerun that changes only such keys continues the run;
- then the schema's ``validate(path)`` method, for what involves several keys (``min_lr <= lr``, batch sizes that
  divide). What needs the world size (``global_batch_size % (micro_batch_size * dp)``) or the model (``pp`` and the
  layers) is checked by the walk, the engine and the task, still before anything is written.

A failure is a :class:`~loong.core.errors.LoongError` naming the dotted key, the value and what is allowed
(``train.steps=-5: must be >= 1``). ``python -m loong.core.config.docs`` writes the reference of every key of every
installed CLI's schema into ``docs/configuration.md`` from these annotations.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from loong.core.config.checks import (
    KEEPS_RUN,
    Check,
    ExistingDir,
    ExistingFile,
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Probability,
    describe,
    hints,
    show,
    split,
    union_arms,
)
from loong.core.errors import LoongError, did_you_mean

#: ``parallel.dp_replicate`` / ``parallel.dp_shard``: a size, or -1 for what the world leaves
MeshSize = Annotated[int, Check(ge=1, also=(-1,), note="-1: what the world leaves")]
#: a decay or moment coefficient in [0, 1)
Decay = Annotated[float, Check(ge=0, lt=1)]


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

    tp: PositiveInt = 1
    pp: PositiveInt = 1
    vpp: PositiveInt | None = None
    cp: PositiveInt = 1
    ep: PositiveInt = 1
    etp: PositiveInt | None = None
    sequence_parallel: bool = False
    fsdp: Literal["full", "hybrid", "none"] = "full"
    dp_replicate: MeshSize = -1
    dp_shard: MeshSize = -1
    cp_ulysses: PositiveInt = 1
    cp_ring: PositiveInt = 1
    fsdp_cpu_offload: bool = False

    def validate(self, path: str) -> None:
        if self.vpp is not None and self.pp == 1:
            raise LoongError(f"{path}.vpp={self.vpp}: virtual pipeline stages need pipeline parallelism; set "
                             f"{path}.pp > 1 or drop {path}.vpp")


@dataclass
class BalanceConfig:
    """Data-parallel load balancing of variable-length samples (``data.balance``).

    ``cost``: ``flops`` (the task's analytic per-sample FLOPs), ``fit`` (start from ``flops``, then
    fit ``a*len**2 + b*len + c`` to the per-rank compute times measured over ``fit_steps`` steps),
    or ``[a, b, c]`` given (``[a, b, c, enc_a, enc_b]`` where samples also run an encoder).
    """

    enabled: bool = False
    cost: Literal["flops", "fit"] | list[NonNegativeFloat] = "flops"
    fit_steps: PositiveInt = 8

    def validate(self, path: str) -> None:
        if not isinstance(self.cost, str) and len(self.cost) not in (3, 5):
            raise LoongError(f"{path}.cost: expected three non-negative coefficients [a, b, c] "
                             f"(cost = a*len^2 + b*len + c), or five with the encoder's [.., enc_a, enc_b], "
                             f"got {self.cost}")


@dataclass
class DataConfig:
    """Where training text comes from. ``path=None`` uses the corpus shipped in the package."""

    path: str | None = None
    format: Literal["auto", "text", "jsonl"] = "auto"
    text_field: NonEmptyStr = "text"
    tokenizer: ExistingDir | None = None
    valid_fraction: Annotated[float, Check(ge=0, lt=1)] = 0.05
    balance: BalanceConfig = field(default_factory=BalanceConfig)


@dataclass
class TrainConfig:
    """The optimisation schedule, batch shape, cadences and run-level switches."""

    # train.steps keeps the run: raising it continues a finished run (the LR schedule then spans the new total)
    steps: Annotated[int, Check(ge=1), KEEPS_RUN] = 200
    seq_length: PositiveInt = 128
    global_batch_size: PositiveInt = 16
    micro_batch_size: PositiveInt = 4
    lr: NonNegativeFloat = 3e-3
    min_lr: NonNegativeFloat = 3e-4
    warmup_steps: NonNegativeInt = 10
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: NonNegativeFloat = 0.1
    adam_beta1: Decay = 0.9
    adam_beta2: Decay = 0.95
    adam_eps: PositiveFloat = 1e-8
    clip_grad: Annotated[float, Check(ge=0, note="0: no clipping")] = 1.0
    seed: Annotated[int, Check(ge=0, le=2**32 - 1)] = 1234
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
    optimizer_offload_fraction: Probability = 1.0
    log_interval: Annotated[int, Check(ge=1), KEEPS_RUN] = 1
    eval_interval: Annotated[int, Check(ge=0, note="0: never"), KEEPS_RUN] = 50
    eval_iters: Annotated[int, Check(ge=0, note="0: no evaluation"), KEEPS_RUN] = 2
    save_interval: Annotated[int, Check(ge=0, note="0: only at the end"), KEEPS_RUN] = 0
    save_final: Annotated[bool, KEEPS_RUN] = True
    keep_last: Annotated[int, Check(ge=0, note="0: keep all"), KEEPS_RUN] = 2
    async_save: Annotated[bool, KEEPS_RUN] = False
    checkpoint_checksums: Annotated[bool, KEEPS_RUN] = True
    on_nonfinite: Annotated[Literal["stop", "skip", "rollback"], KEEPS_RUN] = "stop"
    # hooks on every module's gradients that name where a backward first produces NaN/Inf (slow: for debugging)
    nonfinite_probe: Annotated[bool, KEEPS_RUN] = False
    # auto (this run's newest good checkpoint), none (a fresh run), or a checkpoint path (checked by the walk)
    resume: Annotated[str, Check(nonempty=True), KEEPS_RUN] = "auto"
    save_hf: Annotated[bool, KEEPS_RUN] = False
    progress: Annotated[bool, KEEPS_RUN] = True
    time_limit_s: Annotated[float, Check(ge=0, note="0: none"), KEEPS_RUN] = 0.0
    profile_steps: Annotated[list[PositiveInt], KEEPS_RUN] = field(default_factory=list)
    # fsdp engine: torch.compile each block (graph breaks are printed once, after the first step)
    compile: bool = False
    # fsdp engine, CUDA: capture each micro-batch's forward + backward in a CUDA graph (one per batch shape) and
    # replay it; needs parallel.fsdp=none, model.recompute=none and a task whose step is capture-safe
    cuda_graphs: Annotated[bool, KEEPS_RUN] = False
    # fsdp engine: an exponential moving average of the (fp32, sharded) weights, updated after every optimiser step,
    # ema = decay·ema + (1 − decay)·weights (0: off); saved in checkpoints. export_ema: train.save_hf writes the EMA
    ema_decay: Annotated[float, Check(ge=0, lt=1, note="0: off; e.g. 0.999")] = 0.0
    export_ema: Annotated[bool, KEEPS_RUN] = False

    def validate(self, path: str) -> None:
        if self.export_ema and self.ema_decay == 0.0:
            raise LoongError(f"{path}.export_ema=true exports the EMA of the weights, but {path}.ema_decay=0 keeps "
                             f"none; set {path}.ema_decay (e.g. 0.999) or drop {path}.export_ema")
        if self.global_batch_size % self.micro_batch_size:
            raise LoongError(f"{path}.global_batch_size={self.global_batch_size} is not divisible by "
                             f"{path}.micro_batch_size={self.micro_batch_size}")
        if self.profile_steps and (len(self.profile_steps) != 2 or self.profile_steps[0] > self.profile_steps[1]):
            raise LoongError(f"{path}.profile_steps={self.profile_steps}: give [start, end] with 1 <= start <= end "
                             "(1-based steps, both profiled), or [] for none")
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
    stays bf16 unless ``fp8_output_layer``). ``fp8_output_layer`` (megatron engine, language-model loss): the
    output layer's logits and input-gradient GEMMs in FP8 too, with tensorwise scales, inside the fused linear +
    cross-entropy. See docs/fp8.md.
    """

    fp8: Literal["off", "tensorwise", "rowwise", "blockwise", "adaptive"] = "off"
    fp8_adaptive_threshold: Annotated[float, Check(gt=0, note="a speedup factor such as 1.1")] = 1.1
    fp8_adaptive_recipe: Literal["tensorwise", "rowwise", "blockwise"] = "tensorwise"
    fp8_probe: bool = True
    fp8_table: ExistingFile | None = None
    fp8_exclude: list[NonEmptyStr] = field(default_factory=list)
    fp8_output_layer: bool = False

    def validate(self, path: str) -> None:
        if self.fp8_output_layer and self.fp8 == "off":
            raise LoongError(f"{path}.fp8_output_layer=true adds the output layer to an FP8 run, but {path}.fp8=off; "
                             f"set {path}.fp8 (e.g. {path}.fp8=tensorwise) or {path}.fp8_output_layer=false")


@dataclass
class RunConfig:
    """The root of a run's config. Modalities subclass it to type ``model`` with their schema."""

    task: NonEmptyStr = "llm.pretrain"
    engine: NonEmptyStr = "megatron"
    run_name: Annotated[str, Check(nonempty=True), KEEPS_RUN] | None = None
    output_dir: Annotated[str, Check(nonempty=True), KEEPS_RUN] = "outputs"
    model: Any = None
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)

    def validate(self, path: str) -> None:
        if self.precision.fp8 != "off" and self.train.precision == "fp32":
            raise LoongError(f"precision.fp8={self.precision.fp8} needs bf16 training, but train.precision=fp32; "
                             "set train.precision=bf16 (or auto on a GPU) or precision.fp8=off")


def _shape_matches(value: Any, tp: Any) -> bool:
    """Whether ``value`` is of the kind annotation ``tp`` takes (a list for a list, a string for a Literal of
    strings): the union arm whose error is worth showing."""
    base, _ = split(tp)
    origin = typing.get_origin(base)
    if origin is Literal:
        return any(type(c) is type(value) for c in typing.get_args(base))
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if dataclasses.is_dataclass(base) or base is dict or origin is dict:
        return isinstance(value, dict)
    if base is bool:
        return isinstance(value, bool)
    if base in (int, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(base, type) and isinstance(value, base)


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp`` (light coercion: int→float), raising LoongError."""
    base, meta = split(tp)
    if meta:
        value = _coerce(value, base, path)
        for m in meta:
            if isinstance(m, Check):
                m.check(value, path)
        return value
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    arms = union_arms(tp)
    if arms is not None:
        if value is None and type(None) in arms:
            return None
        options = [a for a in arms if a is not type(None)]
        errors = []
        for arm in options:
            try:
                return _coerce(value, arm, path)
            except LoongError as exc:
                errors.append((arm, str(exc)))
        # one arm, or the one arm of the value's kind: its own message; else what each arm takes (always with a
        # bool arm: a mistyped true/false reads as a string)
        matching = [msg for arm, msg in errors if _shape_matches(value, arm)]
        if len(options) == 1 or (len(matching) == 1 and bool not in options):
            raise LoongError(errors[0][1] if len(options) == 1 else matching[0])
        raise LoongError(f"{path}: {show(value)} is not {describe(tp)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or type(value) not in {type(c) for c in choices}:
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
            if not math.isfinite(value):
                raise LoongError(f"{path}={value}: must be a finite number")
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
    """Build dataclass ``cls`` from ``data``, checking every key (see the module docstring); unknown keys fail
    with their dotted path and the closest key. Paths that must exist are :func:`check_paths`'s."""
    annotations = hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in names:
            raise LoongError(f"unknown config key '{dotted}'{did_you_mean(str(key), names)}")
        kwargs[key] = _coerce(value, annotations[key], dotted)
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if callable(check):
        check(path or cls.__name__)
    return obj


def check_config(obj: Any, path: str = "") -> None:
    """Run every check of ``obj``'s schema (annotations, choices, ``validate``) on an instance built in code, as
    :func:`from_dict` runs them on a composed config; errors name ``path``'s dotted keys."""
    from_dict(type(obj), to_dict(obj), path)


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
