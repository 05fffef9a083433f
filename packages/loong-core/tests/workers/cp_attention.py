"""Context-parallel attention on 4 gloo processes: ``torchrun --nproc-per-node 4 cp_attention.py OUT_JSON``.

Every rank draws the same seeded full q/k/v and output gradient, computes CP=1 attention on them (``cp_attention``
with no groups) and its gradients, checks those against a float64 dense-mask oracle, then runs each layout on its
own shard and compares output and dq/dk/dv with the matching slice of the CP=1 result. Layouts: Ulysses=2 and
ring=2 on two 2-rank CP groups, Ulysses x ring = 2 x 2 (from the group and from a DeviceMesh), ring=4 and
Ulysses=4 on the world; each dense and packed (document ids with padding), causal and not, plus cross-attention to
replicated K/V. Rank 0 writes the largest absolute errors over all ranks as JSON; the test holds the bounds.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from loong.core.attention import (
    CPGroups,
    cp_attention,
    cp_groups_from_group,
    cp_groups_from_mesh,
    gather_sequence,
    shard_sequence,
)
from loong.core.errors import LoongError

B, S, D, S_KV = 2, 40, 8, 12
# two packed rows: documents cross shard borders (10 tokens a shard at CP=4); row 0's last shard is all padding
DOC_LENGTHS = [[5, 11, 3, 7], [2, 23, 4, 11]]
# the replicated context (text tokens) of each row's documents, -1 = padding
KV_DOCS = [[0, 0, 1, 1, 1, 2, 3, 3, 3, 3, -1, -1], [0, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3]]


def doc_ids(lengths: list[list[int]], s: int) -> torch.Tensor:
    rows = []
    for row in lengths:
        ids = [d for d, n in enumerate(row) for _ in range(n)]
        rows.append(ids + [-1] * (s - len(ids)))
    return torch.tensor(rows)


def inputs(seed: int, h: int, h_kv: int, s_kv: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, S, D, generator=g), torch.randn(B, h_kv, s_kv, D, generator=g),
            torch.randn(B, h_kv, s_kv, D, generator=g), torch.randn(B, h, S, D, generator=g)]


def dense_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_doc: torch.Tensor | None,
                 kv_doc: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """float64 attention with an explicit [b, 1, s, s_kv] mask; rows with no key give 0 (not NaN)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    allowed = torch.ones(q.shape[0], 1, q.shape[2], k.shape[2], dtype=torch.bool)
    if q_doc is not None:
        allowed &= ((q_doc[:, :, None] == kv_doc[:, None, :]) & (q_doc >= 0)[:, :, None])[:, None]
    if causal:
        allowed &= torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    some = allowed.any(-1, keepdim=True)
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~(allowed | ~some), float("-inf"))
    return (scores.softmax(-1) @ v) * some


def grads(out: torch.Tensor, leaves: list[torch.Tensor], dy: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, leaves, dy.to(out.dtype)))


def sum_over_cp(t: torch.Tensor, groups: CPGroups) -> torch.Tensor:
    t = t.clone()
    for group in (groups.ulysses, groups.ring):
        if group is not None:
            dist.all_reduce(t, group=group)
    return t


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def run_case(groups: CPGroups, *, packed: bool, causal: bool, replicated: bool, heads: tuple[int, int],
             seed: int) -> tuple[dict[str, float], dict[str, float]]:
    """(errors of this layout against CP=1, errors of CP=1 against the dense oracle) on this rank."""
    s_kv = S_KV if replicated else S
    q, k, v, dy = inputs(seed, *heads, s_kv)
    q_doc = doc_ids(DOC_LENGTHS, S) if packed else None
    kv_doc = (torch.tensor(KV_DOCS) if replicated else q_doc) if packed else None
    kw = {"causal": causal, "kv_replicated": replicated, "kv_doc_ids": kv_doc if replicated else None}

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = cp_attention(*leaves, CPGroups(), doc_ids=q_doc, **kw)
    ref_grads = grads(ref, leaves, dy)
    leaves64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    dense = dense_oracle(*leaves64, q_doc, kv_doc, causal)
    cp1 = {"out": max_abs(ref, dense)}
    cp1.update({f"d{n}": max_abs(a, b) for n, a, b in zip("qkv", ref_grads, grads(dense, leaves64, dy), strict=True)})

    shard = [shard_sequence(q, groups, dim=2)] + [
        t if replicated else shard_sequence(t, groups, dim=2) for t in (k, v)]
    local = [t.clone().requires_grad_(True) for t in shard]
    out = cp_attention(*local, groups, doc_ids=None if q_doc is None else shard_sequence(q_doc, groups), **kw)
    local_grads = grads(out, local, shard_sequence(dy, groups, dim=2))
    err = {"out": max_abs(out, shard_sequence(ref, groups, dim=2)),
           "gathered": max_abs(gather_sequence(out.detach(), groups, dim=2), ref),
           "dq": max_abs(local_grads[0], shard_sequence(ref_grads[0], groups, dim=2))}
    for name, mine, full in zip(("dk", "dv"), local_grads[1:], ref_grads[1:], strict=True):
        # replicated K/V: each rank holds its queries' share of the gradient; the shares sum to it
        err[name] = max_abs(sum_over_cp(mine, groups), full) if replicated else max_abs(
            mine, shard_sequence(full, groups, dim=2))
    return err, cp1


def world_max(errors: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    names = sorted(errors)
    flat = torch.tensor([errors[n][m] for n in names for m in sorted(errors[n])], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    values = iter(flat.tolist())
    return {n: {m: next(values) for m in sorted(errors[n])} for n in names}


def ranks(group: object) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pair = None
    for members in ([0, 1], [2, 3]):  # every rank creates both CP groups of two
        group = dist.new_group(members)
        if rank in members:
            pair = group
    mesh_groups = cp_groups_from_mesh(init_device_mesh("cpu", (4,), mesh_dim_names=("cp",)), 2, 2)
    layouts = {
        "ulysses2": cp_groups_from_group(pair, 2, 1),
        "ring2": cp_groups_from_group(pair, 1, 2),
        "ulysses2xring2": cp_groups_from_group(None, 2, 2),
        "mesh_ulysses2xring2": mesh_groups,
        "ring4": cp_groups_from_group(None, 1, 4),
        "ulysses4": cp_groups_from_group(None, 4, 1),
    }
    errors: dict[str, dict[str, float]] = {}
    cp1: dict[str, dict[str, float]] = {}
    seed = 0
    for layout, groups in layouts.items():
        head_sets = [(4, 2)] + ([(4, 1)] if layout == "ulysses2xring2" else [])  # (4, 1): K/V heads repeated
        for heads in head_sets:
            for packed in (False, True):
                for causal, replicated in ((False, False), (True, False), (False, True)):
                    name = (f"{layout}/h{heads[0]}kv{heads[1]}/{'packed' if packed else 'dense'}/"
                            f"{'cross' if replicated else 'causal' if causal else 'full'}")
                    seed += 1
                    errors[name], cp1[name] = run_case(groups, packed=packed, causal=causal, replicated=replicated,
                                                       heads=heads, seed=seed)

    failures = {}
    world = layouts["ulysses2xring2"]
    for label, heads in {"query_heads": (3, 3), "kv_heads": (6, 3)}.items():
        q, k, v, _ = inputs(0, *heads, S)
        try:
            cp_attention(*(shard_sequence(t, world, dim=2) for t in (q, k, v)), world)
        except LoongError as exc:
            failures[label] = str(exc)

    two_d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    inner = cp_groups_from_mesh(two_d["cp"], 2, 1)
    mesh = {
        "same_as_group": [ranks(mesh_groups.ulysses), ranks(mesh_groups.ring)]
        == [ranks(world.ulysses), ranks(world.ring)],
        "cp_of_dp_x_cp": ranks(inner.ulysses),
        "ranks": [mesh_groups.rank, world.rank],
    }
    report = {"errors": world_max(errors), "cp1": world_max(cp1)}
    every_mesh: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(every_mesh, mesh)
    if rank == 0:
        report.update({"failures": failures, "mesh": every_mesh})
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
