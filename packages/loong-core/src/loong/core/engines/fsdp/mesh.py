"""The fsdp engine's ``DeviceMesh``: dims ``(dp_replicate, dp_shard, cp)`` from ``parallel.*``, passed explicitly.

- ``parallel.fsdp=full``: ``dp_replicate = 1``; parameters are sharded over ``dp_shard × cp``.
- ``parallel.fsdp=hybrid``: HSDP; parameters are sharded over ``dp_shard × cp`` and replicated over
  ``dp_replicate`` (gradients reduce-scattered inside a shard group, all-reduced across replicas).
- ``parallel.fsdp=none``: plain DDP; ``dp_shard = 1``, every rank holds the whole model; gradients are
  all-reduced over ``dp_replicate × cp``.

Context-parallel ranks read the same samples (each takes its part of the sequence), so the data-parallel size is
``dp_replicate × dp_shard`` and the ranks of one CP group share a ``dp_rank``. Sharding over CP as well (as
torchtitan does) keeps one parameter shard per rank whatever the CP size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from loong.core.accelerators.base import Accelerator
from loong.core.attention import CPGroups, cp_groups_from_mesh
from loong.core.config.schema import ParallelConfig
from loong.core.errors import LoongError
from loong.core.parallel import ParallelLayout, destroy_process_group, init_process_group

MESH_DIMS = ("dp_replicate", "dp_shard", "cp")


def check_parallel(p: ParallelConfig) -> None:
    """The world-independent checks of ``parallel.*`` for the fsdp engine; completes ``parallel.cp``."""
    for name in ("tp", "pp", "ep"):
        if getattr(p, name) != 1:
            raise LoongError(f"parallel.{name}={getattr(p, name)}: the fsdp engine has no tensor, pipeline or expert "
                             f"parallelism (shard with parallel.fsdp=full|hybrid, split sequences with "
                             f"parallel.cp_ulysses / parallel.cp_ring); set parallel.{name}=1 or use engine=megatron")
    if p.vpp is not None:
        raise LoongError("parallel.vpp: the fsdp engine has no pipeline; remove parallel.vpp")
    for name in ("cp", "cp_ulysses", "cp_ring"):
        if getattr(p, name) < 1:
            raise LoongError(f"parallel.{name} must be >= 1, got {getattr(p, name)}")
    for name in ("dp_replicate", "dp_shard"):
        if getattr(p, name) < 1 and getattr(p, name) != -1:
            raise LoongError(f"parallel.{name} must be >= 1, or -1 for what the world leaves; got {getattr(p, name)}")
    product = p.cp_ulysses * p.cp_ring
    if p.cp == 1 and product > 1:
        p.cp = product
    elif p.cp > 1 and product == 1:
        p.cp_ulysses = p.cp  # parallel.cp alone: Ulysses, the cheaper of the two where the heads divide
    elif p.cp != product:
        raise LoongError(f"parallel.cp={p.cp} is not parallel.cp_ulysses x parallel.cp_ring = "
                         f"{p.cp_ulysses} x {p.cp_ring}; give the two factors (or parallel.cp alone)")
    if p.fsdp == "full" and p.dp_replicate not in (-1, 1):
        raise LoongError(f"parallel.dp_replicate={p.dp_replicate} with parallel.fsdp=full: full sharding has one "
                         "replica; set parallel.fsdp=hybrid for replicas of shards, or parallel.fsdp=none for DDP")
    if p.fsdp == "none" and p.dp_shard not in (-1, 1):
        raise LoongError(f"parallel.dp_shard={p.dp_shard} with parallel.fsdp=none: DDP does not shard; set "
                         "parallel.fsdp=full or hybrid to shard")
    if p.fsdp_cpu_offload and p.fsdp == "none":
        raise LoongError("parallel.fsdp_cpu_offload=true needs sharding (parallel.fsdp=full or hybrid); DDP keeps "
                         "the whole model on every device")


def mesh_sizes(p: ParallelConfig, world_size: int) -> tuple[int, int]:
    """``(dp_replicate, dp_shard)`` for ``world_size`` ranks (``parallel.cp`` already completed)."""
    if world_size % p.cp:
        raise LoongError(f"world size {world_size} is not divisible by parallel.cp={p.cp}")
    dp = world_size // p.cp
    rep, shard = p.dp_replicate, p.dp_shard
    if p.fsdp == "full":
        rep, shard = 1, dp if shard == -1 else shard
    elif p.fsdp == "none":
        rep, shard = dp if rep == -1 else rep, 1
    elif rep == -1 and shard == -1:
        raise LoongError("parallel.fsdp=hybrid: give parallel.dp_replicate (replicas) or parallel.dp_shard "
                         f"(ranks per shard group) for the {dp} data-parallel ranks")
    elif rep == -1:
        rep = dp // shard if dp % shard == 0 else -1
    elif shard == -1:
        shard = dp // rep if dp % rep == 0 else -1
    if rep * shard != dp:
        raise LoongError(f"parallel.dp_replicate x parallel.dp_shard = {p.dp_replicate} x {p.dp_shard} does not make "
                         f"the {dp} data-parallel ranks of world {world_size} / cp {p.cp} (parallel.fsdp={p.fsdp})")
    return rep, shard


@dataclass
class FSDPLayout(ParallelLayout):
    """The fsdp engine's layout: the mesh and the sub-meshes and groups the engine and the model use."""

    mesh: Any = None  # DeviceMesh with MESH_DIMS
    dp_replicate: int = 1
    dp_shard: int = 1
    #: the mesh ``fully_shard`` takes: ``dp_shard × cp`` (1-D), or ``(dp_replicate, dp_shard × cp)`` for HSDP
    shard_mesh: Any = None
    #: every rank that holds a replica or a shard of the model: gradients and the logged loss average here
    dp_cp_group: Any = None
    #: this rank's Ulysses and ring groups (``loong.core.attention.CPGroups``; empty without CP), for
    #: ``cp_attention`` and ``shard_sequence`` in the model and the task
    cp_groups: Any = None

    @property
    def cp_ulysses(self) -> int:
        return self.config.cp_ulysses

    @property
    def cp_ring(self) -> int:
        return self.config.cp_ring

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp_replicate"].get_local_rank() * self.dp_shard + self.mesh["dp_shard"].get_local_rank()

    @property
    def cp_rank(self) -> int:
        return self.mesh["cp"].get_local_rank()

    @property
    def cp_mesh(self) -> DeviceMesh:
        """The 1-D mesh of this rank's context-parallel group (see ``loong.core.attention`` for its use)."""
        return self.mesh["cp"]

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        cp = f" cp={self.cp} (ulysses {self.cp_ulysses} x ring {self.cp_ring})" if self.cp > 1 else ""
        mode = {"full": "FSDP", "hybrid": "HSDP", "none": "DDP"}[self.config.fsdp]
        return f"{mode} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard}{cp}"

    def record(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "dp": self.dp, "fsdp": self.config.fsdp,
                "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp}


def init_mesh(accelerator: Accelerator, p: ParallelConfig) -> FSDPLayout:
    """Join the default group and build the ``(dp_replicate, dp_shard, cp)`` mesh for ``parallel``."""
    world_size, local_rank, created = init_process_group(accelerator)
    try:
        check_parallel(p)
        rep, shard = mesh_sizes(p, world_size)
    except LoongError:
        if created:
            destroy_process_group()
        raise
    mesh = init_device_mesh(accelerator.device_type, (rep, shard, p.cp), mesh_dim_names=MESH_DIMS)
    shard_cp = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    shard_mesh = mesh["dp_replicate", "dp_shard_cp"] if p.fsdp == "hybrid" else shard_cp
    dp_cp = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp").get_group()
    groups = cp_groups_from_mesh(mesh["cp"], p.cp_ulysses, p.cp_ring) if p.cp > 1 else CPGroups()
    return FSDPLayout(p, world_size, dist.get_rank(), local_rank, rep * shard, created, mesh, rep, shard, shard_mesh,
                      dp_cp, groups)
