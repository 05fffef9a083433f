"""``encoder.decoupled=true`` at ``parallel.pp > 1``: the vision tower runs outside the pipeline schedule.

Every pipeline rank holds a replica of ``encoder`` + ``projector`` (the same initial weights; their gradients are
summed over the pipeline group by :meth:`DecoupledTower.sum_replica_grads` *before* megatron's data-parallel
reduce: after it, the distributed optimiser's reduce-scatter leaves each rank only its own shard of the gradient
buffer, and the replicas sit at different offsets of each stage's buffer, so a later sum would mix shards).
All pipeline ranks of one data-parallel rank load the same micro-batches, so before the schedule runs, pipeline
rank ``r`` embeds the media of micro-batches ``k ≡ r (mod pp)`` (keeping the autograd graph) and sends the
embeddings to the first stage, which feeds them to the foundation as ``visual_embeds`` / ``deepstack_embeds``
(leaf tensors). The tower is then off the pipeline's critical path: each
stage does ``1/pp`` of it before the first micro-batch enters. After the schedule's backward and before the
gradients are reduced, the first stage sends each leaf's gradient back to its owner, whose tower backward
accumulates into its replica's gradient; the pipeline-group sum and then the data-parallel reduce make every
replica's gradient the whole step's (the sum over micro-batches and data-parallel ranks, as the coupled tower's).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from loong.vlm.models.vlm import VisionLanguageModel

Tensor = torch.Tensor
#: batch keys the tower reads
TOWER_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


class DecoupledTower:
    """One step's tower work for this rank's pipeline (see the module docstring). Collective over ``pp_group``."""

    def __init__(self, model: VisionLanguageModel, pp_group: Any, hidden: int, deepstack: int) -> None:
        self.model, self.group, self.hidden, self.deepstack = model, pp_group, hidden, deepstack
        self.rank, self.size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
        self.first = dist.get_global_rank(pp_group, 0)
        # per micro-batch k with media: the owner's (outputs with graph) and the first stage's (leaves)
        self._mine: dict[int, list[Tensor]] = {}
        self._leaves: dict[int, list[Tensor]] = {}

    def _owner(self, k: int) -> int:
        return k % self.size

    def forward(self, batches: list[dict]) -> None:
        """Embed this rank's share of ``batches`` and hand the first stage every micro-batch's embeddings (its
        ``visual_embeds`` / ``deepstack_embeds`` keys)."""
        self._mine, self._leaves = {}, {}
        dtype = self.model.vision_dtype()
        for k, batch in enumerate(batches):
            counts = batch.get("media_tokens")  # host metadata: no device sync (the task's batches have it)
            n = int((batch["mm_token_type_ids"] > 0).sum()) if counts is None else sum(counts)
            if n == 0:
                continue  # every rank sees the same tokens: none of them expects a message
            owner = self._owner(k)
            if owner == self.rank:
                embeds, deep = self.model.visual_inputs(batch["mm_token_type_ids"], media_tokens=counts,
                                                        **{key: batch.get(key) for key in TOWER_KEYS})
                outs = [embeds, *deep]
                self._mine[k] = outs
                if self.rank == 0:
                    self._leaves[k] = [o.detach().requires_grad_(True) for o in outs]
                else:
                    for o in outs:  # point to point, in micro-batch order on both sides (global ranks)
                        dist.send(o.detach().contiguous(), self.first)
            elif self.rank == 0:
                device = batch["mm_token_type_ids"].device
                got = [torch.empty(n, self.hidden, dtype=dtype, device=device) for _ in range(1 + self.deepstack)]
                for t in got:
                    dist.recv(t, dist.get_global_rank(self.group, owner))
                self._leaves[k] = [t.requires_grad_(True) for t in got]
            if self.rank == 0:
                leaves = self._leaves[k]
                batch["visual_embeds"], batch["deepstack_embeds"] = leaves[0], leaves[1:]

    def backward(self) -> None:
        """Return the first stage's embedding gradients to their owners and run the tower's backward there."""
        keys = sorted(set(self._mine) | set(self._leaves)) if self.rank == 0 else sorted(self._mine)
        for k in keys:
            owner = self._owner(k)
            if self.rank == 0:
                grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in self._leaves[k]]
                if owner != 0:
                    for g in grads:
                        dist.send(g.contiguous(), dist.get_global_rank(self.group, owner))
                    continue
            else:
                grads = [torch.empty_like(o) for o in self._mine[k]]
                for g in grads:
                    dist.recv(g, self.first)
            outs = self._mine[k]
            pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self._mine, self._leaves = {}, {}

    def sum_replica_grads(self) -> None:
        """Sum the tower replicas' accumulated gradients (``main_grad``, megatron DDP's buffer) over the pipeline
        group, in place: called after :meth:`backward` and before megatron's data-parallel reduce, when every
        rank's buffer still holds its whole local gradient. (megatron-core's own sum for replicated parameters,
        ``has_cond_embedder``, runs after that reduce: with ``train.distributed_optimizer=true`` only this rank's
        shard of the buffer is reduced then, and the tower's offsets differ between stages.) The replicas are
        built alike on every stage, so the parameters pair up in order; frozen ones have no gradient."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.main_grad for part in (self.model.encoder, self.model.projector)
                 for p in part.parameters() if p.requires_grad]
        if self.size == 1 or not grads:
            return
        summed = _flatten_dense_tensors(grads)
        dist.all_reduce(summed, group=self.group)
        for grad, value in zip(grads, _unflatten_dense_tensors(summed, grads), strict=True):
            grad.copy_(value)


__all__ = ["DecoupledTower"]
