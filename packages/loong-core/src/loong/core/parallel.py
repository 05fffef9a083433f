"""Process groups from a :class:`ParallelConfig`, handed explicitly to the components that use them."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from loong.core.accelerators.base import Accelerator
from loong.core.config.schema import ParallelConfig
from loong.core.errors import LoongError


@dataclass
class ParallelLayout:
    """A resolved layout: sizes, this rank's coordinates and the process-group collection."""

    config: ParallelConfig
    world_size: int
    rank: int
    local_rank: int
    dp: int
    pg_collection: Any  # megatron.core.process_groups_config.ProcessGroupCollection

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def pp(self) -> int:
        return self.config.pp

    @property
    def cp(self) -> int:
        return self.config.cp

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _elastic_store(world_size: int, timeout: datetime.timedelta) -> Any:
    """The torchrun agent's store with keys prefixed by the restart attempt, or None off torchrun.

    The agent keeps one store across elastic restarts (``--max-restarts``), and torch 2.11 does not
    prefix the keys per attempt: the restarted workers then read their predecessors' gloo
    addresses and time out. A per-attempt prefix gives every attempt a clean namespace.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/loong/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_distributed(accelerator: Accelerator, cfg: ParallelConfig) -> ParallelLayout:
    """Join (or create, for a single process) the default group and build megatron-core's groups.

    A process not started by torchrun becomes a world of one on a free local port.
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if "RANK" not in os.environ or os.environ.get("LOONG_SINGLE_PROCESS") == "1":
        # Not started by a launcher: a world of one, on a fresh port each time (runs may follow
        # one another in one process, e.g. `convert` then `train` in a test).
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()), LOONG_SINGLE_PROCESS="1")
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dp = check_layout(cfg, world_size)
    accelerator.set_device(local_rank)
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=30)
        kwargs: dict[str, Any] = {"backend": accelerator.backend, "timeout": timeout}
        store = _elastic_store(world_size, timeout)
        if store is not None:
            kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=world_size)
        if accelerator.device_type == "cuda":
            kwargs["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(**kwargs)
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
    return ParallelLayout(cfg, world_size, dist.get_rank(), local_rank, dp, pgs)


def shutdown_distributed() -> None:
    """Tear down megatron-core's groups, its MoE metrics tracker and the default group."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # megatron keeps per-layer MoE metrics in a module global sized by the first model that records; the
    # next model built in this process (a test, a tool) may have another layer count
    destroy_moe_metrics_tracker()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def world(accelerator: Accelerator, cfg: ParallelConfig | None = None) -> Iterator[ParallelLayout]:
    """The accelerator activated and its process groups up for the block (a world of one outside a
    launcher), torn down after: for tools and tests that build models outside a training run."""
    with accelerator.activate():
        layout = init_distributed(accelerator, cfg or ParallelConfig())
        try:
            yield layout
        finally:
            shutdown_distributed()
