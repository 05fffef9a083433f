"""Loong's linear functions at TP=2 (gloo, CPU): ``torchrun --nproc-per-node 2 fp8_tp.py OUT_JSON``.

A column-parallel then a row-parallel megatron linear (an MLP without its activation), converted to fp8 (GEMMs
emulated) or to the fused weight-gradient accumulation (``wgrad``: fp32, ``dW`` added to a ``main_grad`` that
already holds a gradient, as a second micro-batch finds it), with and without sequence parallelism, against an fp64
single-process reference of the whole weights. A missing or wrong collective (the dgrad all-reduce, the SP
all-gather / reduce-scatter) puts the error near 100%; fp8 rounding alone keeps it near 4%, fp32 near 1e-7. Rank 0
writes the relative errors as JSON.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from loong.core.accelerators import select_accelerator
from loong.core.config.schema import ParallelConfig
from loong.core.engines.megatron.fp8 import convert_to_fp8
from loong.core.engines.megatron.layout import init_distributed, shutdown_distributed
from loong.core.engines.megatron.wgrad_fusion import apply_wgrad_fusion
from loong.core.precision import RECIPES

S, B, H, F = 64, 2, 128, 256


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run(sp: bool, recipe: str, layout) -> dict[str, float]:  # noqa: ANN001
    """``recipe``: an fp8 recipe, or ``wgrad`` for :mod:`loong.core.engines.megatron.wgrad_fusion`."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    tp_group = layout.pg_collection.tp
    rank, tp = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(S, B, H, generator=g), 0.05 * torch.randn(F, H, generator=g), 0.05 * torch.randn(H, F, generator=g)
    dy = torch.randn(S, B, H, generator=g)
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True,
                              params_dtype=torch.float32)
    init = torch.nn.init.zeros_
    fc1 = ColumnParallelLinear(H, F, config=cfg, init_method=init, bias=False, tp_group=tp_group)
    fc2 = RowParallelLinear(F, H, config=cfg, init_method=init, bias=False, input_is_parallel=True,
                            skip_bias_add=False, tp_group=tp_group)
    with torch.no_grad():
        fc1.weight.copy_(w1.chunk(tp, 0)[rank])
        fc2.weight.copy_(w2.chunk(tp, 1)[rank])
    for m in (fc1, fc2):
        if recipe == "wgrad":  # DDP's buffers, holding an earlier micro-batch's gradient (1.0 everywhere)
            apply_wgrad_fusion([m])
            m.weight.main_grad = torch.ones_like(m.weight)
            m.weight.grad_added_to_main_grad = False
        else:
            convert_to_fp8(m, RECIPES[recipe], native=False)
    xin = (x.chunk(tp, 0)[rank] if sp else x).clone().requires_grad_(True)
    out, _ = fc2(fc1(xin)[0])
    out.backward(dy.chunk(tp, 0)[rank] if sp else dy)

    def gather(t: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.contiguous(), group=tp_group)
        return torch.cat(parts, dim)

    xd, w1d, w2d, dyd = x.double(), w1.double(), w2.double(), dy.double()
    h = xd @ w1d.t()
    ref_out = h @ w2d.t()
    ref_dh = dyd @ w2d
    ref_dx = ref_dh @ w1d
    ref_dw2 = dyd.reshape(-1, H).t() @ h.reshape(-1, F)
    ref_dw1 = ref_dh.reshape(-1, F).t() @ xd.reshape(-1, H)
    full_out = gather(out.detach(), 0) if sp else out.detach()
    full_dx = gather(xin.grad, 0) if sp else xin.grad
    if recipe == "wgrad":  # the gradients are in main_grad, on top of the 1.0 already there
        assert fc1.weight.grad_added_to_main_grad and fc2.weight.grad_added_to_main_grad
        dw1, dw2 = fc1.weight.main_grad - 1, fc2.weight.main_grad - 1
    else:
        dw1, dw2 = fc1.weight.grad, fc2.weight.grad
    return {"out": _rel(full_out, ref_out), "dx": _rel(full_dx, ref_dx),
            "dw1": _rel(gather(dw1, 0), ref_dw1), "dw2": _rel(gather(dw2, 1), ref_dw2)}


def main() -> None:
    acc = select_accelerator("cpu")
    results = {}
    with acc.activate():
        layout = init_distributed(acc, ParallelConfig(tp=2))
        try:
            for recipe in ("tensorwise", "rowwise", "blockwise", "wgrad"):
                for sp in (False, True):
                    results[f"{recipe}{'+sp' if sp else ''}"] = run(sp, recipe, layout)
        finally:
            if dist.get_rank() == 0:
                with open(sys.argv[1], "w") as f:
                    json.dump(results, f)
            shutdown_distributed()


if __name__ == "__main__":
    main()
