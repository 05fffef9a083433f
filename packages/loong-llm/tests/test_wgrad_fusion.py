"""The megatron engine's fused weight-gradient accumulation (``loong.core.engines.megatron.wgrad_fusion``) on a tiny
GPT, CPU, fp32: which layers swap, keys unchanged, and megatron DDP's ``main_grad`` after two accumulated
micro-batches equal to megatron's own path. Tensor and sequence parallelism: ``test_fp8_model.py``'s TP=2 launch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_fp8_model import _batch, _gpt, _loss, _rel, _world  # noqa: E402


def test_fused_accumulation_equals_megatrons_path_over_two_micro_batches() -> None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from loong.core.engines.megatron.wgrad_fusion import apply_wgrad_fusion, remove_wgrad_fusion

    with _world() as (_acc, layout):
        grads, outputs = [], []
        for fused in (False, True):
            model, tc = _gpt(layout)
            keys = list(model.state_dict())
            if fused:
                assert apply_wgrad_fusion([model]) == 8  # 2 layers x (qkv, proj, fc1, fc2); not the output layer
                qkv, fc2 = model.decoder.layers[0].self_attention.linear_qkv, model.decoder.layers[1].mlp.linear_fc2
                assert type(qkv).__name__ == "FusedWgradColumnParallelLinear" and isinstance(qkv, ColumnParallelLinear)
                assert type(fc2).__name__ == "FusedWgradRowParallelLinear" and isinstance(fc2, RowParallelLinear)
                assert type(model.output_layer) is ColumnParallelLinear  # the fused loss's condition
                assert list(model.state_dict()) == keys
            ddp = DistributedDataParallel(tc, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model,
                                          pg_collection=layout.pg_collection)
            ddp.zero_grad_buffer()
            for seed in (1, 2):  # the second micro-batch adds to what the first left in main_grad
                loss = _loss(ddp, _batch(seed))
                loss.backward()
            outputs.append(float(loss.detach()))
            ddp.finish_grad_sync()
            grads.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
            if fused:
                assert qkv.weight.grad is None and qkv.weight.grad_added_to_main_grad
                assert remove_wgrad_fusion([model]) == 8 and type(qkv) is ColumnParallelLinear
        assert outputs[0] == outputs[1]  # the forward is megatron's matmul
        for name, ref in grads[0].items():
            assert ref.abs().sum() > 0, name
            assert _rel(grads[1][name], ref) < 1e-6, (name, _rel(grads[1][name], ref))


def test_frozen_layers_and_a_model_without_ddp_keep_their_gradients() -> None:
    """No ``main_grad`` (no DDP): dW goes to autograd as before; a frozen weight gets none."""
    from loong.core.engines.megatron.wgrad_fusion import apply_wgrad_fusion

    with _world() as (_acc, layout):
        ref, _ = _gpt(layout)
        model, _ = _gpt(layout)
        apply_wgrad_fusion([model])
        frozen = model.decoder.layers[0].mlp.linear_fc1.weight
        frozen.requires_grad_(False)
        ref.decoder.layers[0].mlp.linear_fc1.weight.requires_grad_(False)
        for m in (ref, model):
            _loss(m, _batch()).backward()
        assert frozen.grad is None
        for (name, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
            if a.requires_grad:
                assert torch.allclose(b.grad, a.grad, rtol=1e-6, atol=1e-7), name


@pytest.mark.gpu
def test_gpu_bf16_weight_gradient_accumulates_in_fp32_main_grad() -> None:
    """On CUDA the bf16 operands' product goes into the fp32 buffer unrounded: within fp32 accumulation error of fp64
    (the unfused path rounds dW to bf16 first, about 2e-3), added to what the buffer held."""
    from loong.core.engines.megatron.wgrad_fusion import FusedWgradLinearFunction
    from loong.core.precision.fp8_linear import LinearComm

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 512, 256, device="cuda", generator=g).bfloat16().requires_grad_(True)
    w = torch.randn(384, 256, device="cuda", generator=g).bfloat16().requires_grad_(True)
    dy = torch.randn(2, 512, 384, device="cuda", generator=g).bfloat16()
    w.main_grad = torch.full(w.shape, 0.5, device="cuda", dtype=torch.float32)
    w.grad_added_to_main_grad = False
    y = FusedWgradLinearFunction.apply(x, w, None, LinearComm(gradient_accumulation_fusion=True))
    y.backward(dy)
    ref_dw = dy.double().reshape(-1, 384).t() @ x.double().reshape(-1, 256)
    assert _rel(w.main_grad.double() - 0.5, ref_dw) < 1e-5
    assert w.grad_added_to_main_grad and w.main_grad.dtype == torch.float32
    assert _rel(x.grad, dy.double() @ w.double()) < 1e-2 and _rel(y, x.double() @ w.double().t()) < 1e-2
