"""The engine-neutral part of a run's parallelism: joining the default process group, and the layout facts the
walk and the trainer read (world, data-parallel rank, the logging rank).

Each engine builds its own groups on top (``loong.core.engines.megatron.layout``: megatron-core's
``ProcessGroupCollection``; ``loong.core.engines.fsdp.mesh``: a torch ``DeviceMesh``) and returns a
:class:`ParallelLayout` subclass that carries them; nothing is kept in module globals.
"""

from __future__ import annotations

import datetime
import os
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from loong.core.accelerators.base import Accelerator
from loong.core.config.schema import ParallelConfig


@dataclass
class ParallelLayout(ABC):
    """A resolved layout: sizes and this rank's coordinates. Engines subclass it with their groups."""

    config: ParallelConfig
    world_size: int
    rank: int
    local_rank: int
    dp: int
    #: whether the walk created the default process group (and so destroys it at the end); a caller that
    #: initialised torch.distributed itself keeps its group across runs
    owns_group: bool = True

    @property
    def cp(self) -> int:
        return self.config.cp

    @property
    @abstractmethod
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas (which slice of the global batch it reads)."""

    @property
    @abstractmethod
    def is_logging_rank(self) -> bool:
        """The one rank that prints and writes logs."""

    def describe(self) -> str:
        """The layout in a few words, for the run's first line (``tp=2 pp=1 dp=4``)."""
        return f"dp={self.dp}"

    def record(self) -> dict[str, Any]:
        """The layout saved in ``trainer_state.json``."""
        return {"world_size": self.world_size, "dp": self.dp}


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


def init_process_group(accelerator: Accelerator) -> tuple[int, int, bool]:
    """Join the default group (or create a world of one outside a launcher); returns (world size, local rank,
    whether this call created the group).

    A process not started by torchrun becomes a world of one on a free local port, fresh each time (runs may
    follow one another in one process, e.g. ``convert`` then ``train`` in a test).
    """
    if not dist.is_initialized() and ("RANK" not in os.environ or os.environ.get("LOONG_SINGLE_PROCESS") == "1"):
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()), LOONG_SINGLE_PROCESS="1")
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    accelerator.set_device(local_rank)
    if dist.is_initialized():
        return dist.get_world_size(), local_rank, False
    timeout = datetime.timedelta(minutes=30)
    kwargs: dict[str, Any] = {"backend": accelerator.backend, "timeout": timeout}
    store = _elastic_store(world_size, timeout)
    if store is not None:
        kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=world_size)
    if accelerator.device_type == "cuda":
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(**kwargs)
    return world_size, local_rank, True


def destroy_process_group(barrier: bool = False) -> None:
    """Leave the default group (a no-op when none is up).

    ``barrier`` (a run that ended cleanly on every rank) first waits for all ranks: a rank that tears its gloo
    groups down while a peer still has the last step's collectives in flight can abort that peer at exit
    ("terminate called without an active exception"). Never after a failure: the failed rank's peers would
    wait in the barrier for it.
    """
    if dist.is_initialized():
        if barrier and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
