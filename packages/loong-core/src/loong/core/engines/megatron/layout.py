"""megatron-core's process groups for a run: ``initialize_model_parallel`` once, its ``ProcessGroupCollection``
handed explicitly to the model, DDP and the engine; and one collection per *component* with its own
tensor-parallel size (a VLM's vision encoder at ``encoder.parallel.tp``), built here from the layout and handed to
that component by its task (:attr:`MegatronLayout.components`), never through module globals."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from loong.core.accelerators.base import Accelerator
from loong.core.config.schema import ParallelConfig
from loong.core.errors import LoongError
from loong.core.parallel import ParallelLayout, destroy_process_group, init_process_group


@dataclass
class MegatronLayout(ParallelLayout):
    """A megatron layout: tp/pp/cp/ep sizes and the process-group collection."""

    pg_collection: Any = None  # megatron.core.process_groups_config.ProcessGroupCollection
    #: component name -> its ProcessGroupCollection (:func:`component_process_groups`): its own ``tp`` group, the
    #: model's ``pp`` / ``cp`` / ``dp`` / ``dp_cp`` groups
    components: dict[str, Any] = field(default_factory=dict)

    def component(self, name: str) -> Any:
        """The process-group collection of component ``name``; a LoongError when the layout was built without it
        (:func:`init_distributed`'s ``components``)."""
        if name not in self.components:
            raise LoongError(f"the layout has no process groups for component {name!r} (built for "
                             f"{sorted(self.components) or 'none'}); pass it to init_distributed's components")
        return self.components[name]

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def pp(self) -> int:
        return self.config.pp

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.pg_collection.dp)

    @property
    def is_first_stage(self) -> bool:
        return dist.get_rank(self.pg_collection.pp) == 0

    @property
    def is_last_stage(self) -> bool:
        return dist.get_rank(self.pg_collection.pp) == self.pp - 1

    @property
    def is_logging_rank(self) -> bool:
        """The rank that prints and writes logs: DP/TP rank 0 on the last pipeline stage."""
        return (
            self.is_last_stage
            and dist.get_rank(self.pg_collection.tp) == 0
            and self.dp_rank == 0
            and dist.get_rank(self.pg_collection.cp) == 0
        )

    def describe(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("cp", self.cp), ("ep", self.config.ep)) if v > 1)
        return f"tp={self.tp} pp={self.pp}{extra} dp={self.dp}"

    def record(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "tp": self.tp, "pp": self.pp, "dp": self.dp}


def check_layout(cfg: ParallelConfig, world_size: int) -> int:
    """Validate sizes against the world size; return the data-parallel size."""
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(cfg, name) < 1:
            raise LoongError(f"parallel.{name} must be >= 1, got {getattr(cfg, name)}")
    model_parallel = cfg.tp * cfg.pp * cfg.cp
    if world_size % model_parallel:
        raise LoongError(
            f"world size {world_size} is not divisible by parallel.tp*pp*cp = "
            f"{cfg.tp}*{cfg.pp}*{cfg.cp} = {model_parallel}"
        )
    dp = world_size // model_parallel
    etp = cfg.etp or cfg.tp
    if (dp * cfg.cp * cfg.tp) % (cfg.ep * etp):
        raise LoongError(f"parallel.ep={cfg.ep} (with etp={etp}) must divide dp*cp*tp={dp * cfg.cp * cfg.tp}")
    if cfg.vpp is not None and cfg.pp == 1:
        raise LoongError("parallel.vpp needs parallel.pp > 1")
    return dp


def check_component_tp(name: str, tp: int, model_tp: int) -> None:
    """A component's tensor-parallel size must divide the model's ``parallel.tp`` (its groups are consecutive
    sub-blocks of the model's tensor-parallel groups)."""
    if tp < 1 or model_tp % tp:
        raise LoongError(f"{name}.parallel.tp={tp} must divide parallel.tp={model_tp} (the component's "
                         "tensor-parallel groups are consecutive sub-blocks of the model's); allowed: "
                         f"{', '.join(str(d) for d in range(1, model_tp + 1) if model_tp % d == 0)}")


def sequence_multiple(tp: int, cp: int, sequence_parallel: bool) -> int:
    """What every row's length must divide by for the megatron engine's sequence splits: ``2 * cp`` under context
    parallelism (each CP rank holds two of ``2 * cp`` equal chunks, megatron's load-balanced layout) and, under
    sequence parallelism at ``tp > 1``, ``cp * tp`` (each tensor-parallel rank holds an equal slice of its CP rank's
    tokens); 1 where nothing splits the sequence."""
    cp_split = 2 * cp if cp > 1 else 1
    sp_split = cp * tp if sequence_parallel and tp > 1 else 1
    return math.lcm(cp_split, sp_split)


def nearest_multiples(value: int, multiple: int) -> str:
    """The multiples of ``multiple`` next to ``value`` (below it when there is one, and above), for an error's
    "allowed" hint."""
    below = value // multiple * multiple
    return f"{below} or {below + multiple}" if below else str(multiple)


def check_sequence_split(seq_length: int, tp: int, cp: int, sequence_parallel: bool,
                         why: str = "parallel.sequence_parallel=true", key: str = "train.seq_length") -> None:
    """Refuse a row length (``key``) that context parallelism (``cp``) or sequence parallelism (``tp``, when
    ``sequence_parallel``; ``why``: what turned it on) cannot split into equal parts (:func:`sequence_multiple`).
    megatron-core would stop in the first forward on a bare assertion, after the run directory is written."""
    allowed = sequence_multiple(tp, cp, sequence_parallel)
    if not seq_length % allowed:
        return
    hint = f"allowed: multiples of {allowed}, e.g. {nearest_multiples(seq_length, allowed)}"
    if cp > 1 and seq_length % (2 * cp):
        raise LoongError(f"parallel.cp={cp}: {key}={seq_length} must divide by 2 * cp = {2 * cp} (each CP rank holds "
                         f"two of 2 * cp equal chunks of every row); {hint}")
    if cp > 1:
        raise LoongError(f"{key}={seq_length} must divide by parallel.cp x parallel.tp = {cp * tp} under sequence "
                         f"parallelism with context parallelism ({why}): each tensor-parallel rank holds an equal "
                         f"slice of its CP rank's share of every row; {hint}")
    raise LoongError(f"{key}={seq_length} must divide by parallel.tp={tp} under sequence parallelism ({why}): each "
                     f"tensor-parallel rank holds an equal slice of every row; {hint}")


def component_process_groups(pgs: Any, tp: int) -> Any:
    """A ``ProcessGroupCollection`` for a component at tensor-parallel size ``tp`` (dividing the model's): its
    ``tp`` group is this rank's block of ``tp`` consecutive ranks of the model's tensor-parallel group (the model's
    own group when the sizes are equal); ``pp``, ``cp``, ``dp``, ``dp_cp`` are the model's. Ranks in different
    blocks of one model-TP group hold replicas of the component. Collective over the world (every rank creates
    every block's group, in the same order)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    shared = {"pp": pgs.pp, "cp": pgs.cp, "dp": pgs.dp, "dp_cp": pgs.dp_cp}
    if tp == pgs.tp.size():
        return ProcessGroupCollection(tp=pgs.tp, **shared)
    model_groups: list = [None] * dist.get_world_size()
    dist.all_gather_object(model_groups, dist.get_process_group_ranks(pgs.tp))
    mine = None
    for ranks in sorted({tuple(r) for r in model_groups}):
        for first in range(0, len(ranks), tp):
            block = list(ranks[first:first + tp])
            group = dist.new_group(block)
            if dist.get_rank() in block:
                mine = group
    return ProcessGroupCollection(tp=mine, **shared)


def init_distributed(accelerator: Accelerator, cfg: ParallelConfig,
                     components: Mapping[str, int] | None = None) -> MegatronLayout:
    """Join (or create, for a single process) the default group and build megatron-core's groups, plus one
    collection per entry of ``components`` (component name -> its tensor-parallel size, dividing ``cfg.tp``)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    world_size, local_rank, created = init_process_group(accelerator)
    try:
        dp = check_layout(cfg, world_size)
        for name, tp in (components or {}).items():
            check_component_tp(name, tp, cfg.tp)
    except LoongError:
        if created:
            destroy_process_group()
        raise
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.vpp,
        context_parallel_size=cfg.cp,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.etp,
    )
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    groups = {name: component_process_groups(pgs, tp) for name, tp in (components or {}).items()}
    return MegatronLayout(cfg, world_size, dist.get_rank(), local_rank, dp, created, pgs, groups)


def shutdown_distributed(destroy_default: bool = True, barrier: bool = False) -> None:
    """Tear down megatron-core's groups, its MoE metrics tracker and (``destroy_default``) the default group
    (``barrier``: after every rank arrives, see :func:`loong.core.parallel.destroy_process_group`)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # megatron keeps per-layer MoE metrics in a module global sized by the first model that records; the
    # next model built in this process (a test, a tool) may have another layer count
    destroy_moe_metrics_tracker()
    if destroy_default:
        destroy_process_group(barrier=barrier)


@contextlib.contextmanager
def world(accelerator: Accelerator, cfg: ParallelConfig | None = None) -> Iterator[MegatronLayout]:
    """The accelerator activated for megatron-core and its process groups up for the block (a world of one outside
    a launcher), torn down after: for tools and tests that build models outside a training run."""
    with accelerator.activate(engine="megatron"):
        layout = init_distributed(accelerator, cfg or ParallelConfig())
        try:
            yield layout
        finally:
            shutdown_distributed()
