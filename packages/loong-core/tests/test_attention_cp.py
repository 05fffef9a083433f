"""Context-parallel attention (``loong.core.attention``): Ulysses, ring and both, against CP=1.

One launch of 4 gloo processes (``workers/cp_attention.py``) runs every layout — Ulysses=2 and ring=2 on two
2-rank CP groups, Ulysses x ring = 2 x 2 (from a process group and from a DeviceMesh), ring=4, Ulysses=4 — dense and
packed, causal and not, and cross-attention to replicated K/V, each in the output and in dq/dk/dv. In-process
tests cover the blocks that ring attention is made of: the log-sum-exp merge and the block backward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loong.core.attention import block_backward, block_forward, kv_head_repeat, merge_blocks, ring_attention
from loong.core.errors import LoongError

TOLERANCE = 1e-5  # fp32; the measured errors are about 1e-6


@pytest.fixture(scope="module")
def cp_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("cp_attention") / "report.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "LOONG_SINGLE_PROCESS")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           str(Path(__file__).parent / "workers" / "cp_attention.py"), str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_layout_matches_cp1_in_output_and_gradients(cp_report: dict) -> None:
    errors = cp_report["errors"]
    layouts = ["ulysses2", "ring2", "ulysses2xring2", "mesh_ulysses2xring2", "ring4", "ulysses4"]
    expected = {f"{layout}/h4kv2/{kind}/{mode}" for layout in layouts for kind in ("dense", "packed")
                for mode in ("full", "causal", "cross")}
    expected |= {f"ulysses2xring2/h4kv1/{kind}/{mode}" for kind in ("dense", "packed")
                 for mode in ("full", "causal", "cross")}
    assert set(errors) == expected
    for name, errs in errors.items():
        assert set(errs) == {"out", "gathered", "dq", "dk", "dv"}, name
        assert max(errs.values()) <= TOLERANCE, (name, errs)
    # the CP=1 reference itself agrees with a float64 dense-mask oracle
    for name, errs in cp_report["cp1"].items():
        assert max(errs.values()) <= TOLERANCE, (name, errs)


@pytest.mark.slow
def test_head_counts_that_do_not_split_fail_clearly(cp_report: dict) -> None:
    failures = cp_report["failures"]
    assert "3 query heads do not divide by 2" in failures["query_heads"]
    assert "3 is neither a multiple nor a divisor of 2" in failures["kv_heads"]


@pytest.mark.slow
def test_groups_from_a_mesh_are_the_groups_from_a_process_group(cp_report: dict) -> None:
    mesh = cp_report["mesh"]
    assert all(m["same_as_group"] for m in mesh)
    assert [m["ranks"] for m in mesh] == [[r, r] for r in range(4)]  # CP rank = ring_rank * 2 + ulysses_rank
    # the cp dimension of a ("dp", "cp") mesh: Ulysses over the cp neighbours
    assert [m["cp_of_dp_x_cp"] for m in mesh] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_kv_head_repeat() -> None:
    assert kv_head_repeat(8, 4, 2) == 1
    assert kv_head_repeat(8, 2, 4) == 2  # two K/V heads over four ranks: each repeated twice
    assert kv_head_repeat(8, 1, 8) == 8
    with pytest.raises(LoongError, match="6 query heads do not divide by 4"):
        kv_head_repeat(6, 3, 4)
    with pytest.raises(LoongError, match="3 is neither a multiple nor a divisor of 2"):
        kv_head_repeat(6, 3, 2)


def _qkv(h: int = 4, h_kv: int = 2, s: int = 24, d: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, s, d, generator=g, dtype=torch.float64) for n in (h, h_kv, h_kv)]


def test_merged_blocks_equal_attention_over_all_keys() -> None:
    """Keys cut into three blocks, merged by their log-sum-exps: the output and LSE of attention over all keys."""
    q, k, v = _qkv()
    scale = 8**-0.5
    whole, whole_lse = block_forward(q, k, v, scale=scale)
    cuts = [(0, 5), (5, 17), (17, 24)]
    out, lse = block_forward(q, k[:, :, :5], v[:, :, :5], scale=scale)
    for a, b in cuts[1:]:
        out, lse = merge_blocks(out, lse, *block_forward(q, k[:, :, a:b], v[:, :, a:b], scale=scale))
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert torch.allclose(whole, expected, atol=1e-12) and torch.allclose(out, expected, atol=1e-12)
    assert torch.allclose(lse, whole_lse, atol=1e-12)
    # a block where some rows see no key (another document) merges as nothing: no NaN, the other block's rows
    doc_q = torch.tensor([[0] * 12 + [1] * 12] * 2)
    empty_out, empty_lse = block_forward(q, k[:, :, :6], v[:, :, :6], doc_q, torch.ones(2, 6, dtype=torch.long),
                                         scale=scale)
    assert torch.isneginf(empty_lse[:, :, :12]).all() and (empty_out[:, :, :12] == 0).all()
    merged, merged_lse = merge_blocks(whole, whole_lse, empty_out, empty_lse)
    assert not merged.isnan().any() and torch.allclose(merged[:, :, :12], whole[:, :, :12], atol=1e-12)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_block_backward_from_the_merged_lse_is_the_gradient(causal: bool) -> None:
    """Two key blocks' backward shares, each from the *merged* output and LSE, sum to autograd's gradient; and a
    ring of one rank (blockwise attention's own autograd Function) gives it too."""
    q, k, v = (t.requires_grad_(True) for t in _qkv(seed=1))
    dy = torch.randn(2, 4, 24, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    want = torch.autograd.grad(expected, (q, k, v), dy)
    scale = 8**-0.5
    if not causal:
        with torch.no_grad():
            halves = [(0, 10), (10, 24)]
            parts = [block_forward(q, k[:, :, a:b], v[:, :, a:b], scale=scale) for a, b in halves]
            out, lse = merge_blocks(*parts[0], *parts[1])
            dq = torch.zeros_like(q)
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)
            for a, b in halves:
                bq, bk, bv = block_backward(dy, q, k[:, :, a:b], v[:, :, a:b], out, lse, scale=scale)
                dq += bq
                dk[:, :, a:b] += bk
                dv[:, :, a:b] += bv
        for got, ref in zip((dq, dk, dv), want, strict=True):
            assert torch.allclose(got, ref, atol=1e-12)
    out = ring_attention(q, k, v, None, causal=causal)
    assert torch.allclose(out, expected, atol=1e-12)
    for got, ref in zip(torch.autograd.grad(out, (q, k, v), dy), want, strict=True):
        assert torch.allclose(got, ref, atol=1e-12)
