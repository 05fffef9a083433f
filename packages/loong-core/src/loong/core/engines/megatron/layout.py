"""megatron-core's process groups for a run: ``initialize_model_parallel`` once, its ``ProcessGroupCollection``
handed explicitly to the model, DDP and the engine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
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


def init_distributed(accelerator: Accelerator, cfg: ParallelConfig) -> MegatronLayout:
    """Join (or create, for a single process) the default group and build megatron-core's groups."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    world_size, local_rank, created = init_process_group(accelerator)
    try:
        dp = check_layout(cfg, world_size)
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
    return MegatronLayout(cfg, world_size, dist.get_rank(), local_rank, dp, created, pgs)


def shutdown_distributed(destroy_default: bool = True) -> None:
    """Tear down megatron-core's groups, its MoE metrics tracker and (``destroy_default``) the default group."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # megatron keeps per-layer MoE metrics in a module global sized by the first model that records; the
    # next model built in this process (a test, a tool) may have another layer count
    destroy_moe_metrics_tracker()
    if destroy_default:
        destroy_process_group()


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
