"""RoPE: tables (llama3 scaling, M-RoPE) and the rotation, against the reference, megatron-core and HF."""

from __future__ import annotations

import types

import pytest
import torch

from loong.kernels import (
    KernelUnsupportedError,
    Llama3RopeScaling,
    apply_rope,
    apply_rope_reference,
    rope_cos_sin,
    rope_inv_freq,
)

LLAMA3 = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)


def _qk(shape_q, shape_k, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape_q, generator=g).to(dtype).requires_grad_(),
            torch.randn(shape_k, generator=g).to(dtype).requires_grad_())


def _fwd_bwd(fn, q, k, cos, sin, seed=1, **kw):
    qo, ko = fn(q, k, cos, sin, **kw)
    g = torch.Generator().manual_seed(seed)
    loss = (qo.float() * torch.randn(qo.shape, generator=g)).sum() + (ko.float() * torch.randn(ko.shape, generator=g)).sum()
    return (qo, ko), torch.autograd.grad(loss, (q, k))


def _triton(*a, **k):
    return apply_rope(*a, **k, backend="triton")


CASES = [  # layout, q shape, k shape (GQA: fewer heads), rotary_dim, per-sample positions
    ("sbhd", (7, 3, 5, 40), (7, 3, 2, 40), 40, False),
    ("sbhd", (6, 2, 3, 48), (6, 2, 1, 48), 24, True),  # partial rotary
    ("bshd", (2, 9, 3, 34), (2, 9, 3, 34), 34, True),
    ("bhsd", (3, 4, 5, 18), (3, 2, 5, 18), 12, False),
    ("thd", (11, 3, 20), (11, 1, 20), 20, False),
]


def _tables(layout, q_shape, rot, per_sample, seed=2):
    s, b = {"sbhd": q_shape[:2], "bshd": q_shape[1::-1], "bhsd": (q_shape[2], q_shape[0]),
            "thd": (q_shape[0], 1)}[layout]
    g = torch.Generator().manual_seed(seed)
    inv = rope_inv_freq(rot, 10000.0)
    pos = torch.randint(0, 1000, (b, s), generator=g) if per_sample else torch.arange(s) + 3
    return rope_cos_sin(pos, inv)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_fp32_matches_reference(interpret, check, case, interleaved):
    layout, qs, ks, rot, per_sample = case
    q, k = _qk(qs, ks)
    cos, sin = _tables(layout, qs, rot, per_sample)
    outs_k, grads_k = _fwd_bwd(_triton, q, k, cos, sin, layout=layout, interleaved=interleaved)
    outs_r, grads_r = _fwd_bwd(apply_rope_reference, q, k, cos, sin, layout=layout, interleaved=interleaved)
    for a, b in zip(outs_k + grads_k, outs_r + grads_r, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert check.rel_err(a, b) < 1e-6


def test_bf16_no_worse_than_reference(interpret, check):
    q, k = _qk((9, 2, 4, 32), (9, 2, 2, 32), torch.bfloat16)
    cos, sin = _tables("sbhd", q.shape, 32, True)
    outs_k, grads_k = _fwd_bwd(_triton, q, k, cos, sin)
    outs_r, grads_r = _fwd_bwd(apply_rope_reference, q, k, cos, sin)
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    outs_e, grads_e = _fwd_bwd(apply_rope_reference, q64, k64, cos.double(), sin.double())
    for a, r, e in zip(outs_k + grads_k, outs_r + grads_r, outs_e + grads_e, strict=True):
        assert a.dtype == torch.bfloat16
        check.no_worse(a, r, e)


def test_inplace_and_views_of_a_fused_qkv(interpret, check):
    s, b, d = 5, 2, 16
    qkv = torch.randn(s, b, 3 * 4 * d)
    q = qkv[..., : 4 * d].view(s, b, 4, d)  # strided views: rows 3*4*d apart, no copy needed
    k = qkv[..., 4 * d: 8 * d].view(s, b, 4, d)
    v_before = qkv[..., 8 * d:].clone()
    cos, sin = _tables("sbhd", q.shape, d, False)
    want_q, want_k = apply_rope_reference(q, k, cos, sin)
    got_q, got_k = apply_rope(q, k, cos, sin, inplace=True, backend="triton")
    assert got_q is q and got_k is k
    assert check.rel_err(q, want_q) < 1e-6 and check.rel_err(k, want_k) < 1e-6
    assert torch.equal(qkv[..., 8 * d:], v_before)  # the neighbouring v channels are not written


def test_inplace_autograd(interpret, check):
    base_q, base_k = _qk((4, 2, 3, 8), (4, 2, 1, 8))
    cos, sin = _tables("sbhd", base_q.shape, 8, True)
    q, k = base_q * 1.0, base_k * 1.0  # non-leaf tensors may be modified in place
    qo, ko = apply_rope(q, k, cos, sin, inplace=True, backend="triton")
    (qo.sum() + (ko * 2).sum()).backward()
    qr, kr = apply_rope_reference(base_q.detach(), base_k.detach(), cos, sin)
    assert check.rel_err(qo, qr) < 1e-6 and check.rel_err(ko, kr) < 1e-6
    g = torch.autograd.grad(sum(o.sum() * w for o, w in zip(apply_rope_reference(
        base_q, base_k, cos, sin), (1.0, 2.0), strict=True)), (base_q, base_k))
    assert check.rel_err(base_q.grad, g[0]) < 1e-6 and check.rel_err(base_k.grad, g[1]) < 1e-6


def test_q_and_k_rotate_in_one_launch_each_way(interpret, check, monkeypatch):
    """q and k (GQA, different strides) share one kernel launch forward and one backward, as issue 26 asks."""
    from loong.kernels import rope as rope_mod

    launches = []
    kernel = rope_mod._rope_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(rope_mod, "_rope_kernel", Counting())
    base = torch.randn(6, 2, 4 * 8 + 2 * 8 * 2, requires_grad=True)  # fused q (4 heads) | k (2) | v (2), width 8
    q, k = base[..., :32].unflatten(-1, (4, 8)), base[..., 32:48].unflatten(-1, (2, 8))
    cos, sin = _tables("sbhd", q.shape, 8, True)
    qo, ko = apply_rope(q, k, cos, sin, backend="triton")
    assert len(launches) == 1
    probe_q, probe_k = torch.randn(qo.shape), torch.randn(ko.shape)
    got = torch.autograd.grad((qo * probe_q).sum() + (ko * probe_k).sum(), base)[0]
    assert len(launches) == 2
    qr, kr = apply_rope_reference(q, k, cos, sin)
    want = torch.autograd.grad((qr * probe_q).sum() + (kr * probe_k).sum(), base)[0]
    assert check.rel_err(qo, qr) < 1e-6 and check.rel_err(ko, kr) < 1e-6 and check.rel_err(got, want) < 1e-6


def test_k_none_and_finite_differences(interpret, check):
    q, _ = _qk((5, 2, 3, 12), (1,))
    cos, sin = _tables("sbhd", q.shape, 8, True)
    qo, ko = apply_rope(q, None, cos, sin, backend="triton")
    assert ko is None
    probe = torch.randn(qo.shape, generator=torch.Generator().manual_seed(4))
    analytic, numeric = check.directional_fd(
        lambda t: (apply_rope(t, None, cos, sin, interleaved=True, backend="triton")[0] * probe).sum(), [q])
    assert analytic == pytest.approx(numeric, rel=2e-3)


def test_matches_megatron_core(interpret, check):
    """megatron-core's unfused bshd path (its [s, b, h, d] layout) with freqs = cat(f, f) / interleaved."""
    rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")
    s, b, h, d, rot = 6, 2, 3, 32, 16
    q = torch.randn(s, b, h, d)
    inv = rope_inv_freq(rot, 500000.0, llama3=LLAMA3)
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    cos, sin = rope_cos_sin(torch.arange(s), inv)
    for interleaved in (False, True):
        emb = torch.stack((freqs, freqs), -1).flatten(-2) if interleaved else torch.cat((freqs, freqs), -1)
        want = rope_utils._apply_rotary_pos_emb_bshd(q, emb[:, None, None, :], rotary_interleaved=interleaved)
        got, _ = apply_rope(q, None, cos, sin, interleaved=interleaved, backend="triton")
        assert check.rel_err(got, want) < 1e-6


def test_llama3_inv_freq_matches_transformers():
    init = pytest.importorskip("transformers.modeling_rope_utils").ROPE_INIT_FUNCTIONS["llama3"]
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=1024, num_attention_heads=8, max_position_embeddings=131072,
                      rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192))
    want, _ = init(cfg, "cpu")
    got = rope_inv_freq(128, 500000.0, llama3=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                    original_max_position_embeddings=8192))
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(got, rope_inv_freq(128, 500000.0))  # the scaling did something


@pytest.mark.parametrize("interleaved_mrope", [False, True])
def test_mrope_matches_transformers_qwen_vl(interpret, check, interleaved_mrope):
    """Qwen2-VL (sections) and Qwen3-VL (interleaved) tables and application, HF layout [b, h, s, d]."""
    if interleaved_mrope:
        mod = pytest.importorskip("transformers.models.qwen3_vl.modeling_qwen3_vl")
        recompose, section = mod.Qwen3VLTextRotaryEmbedding.recomposition_frequencies, [8, 4, 4]
    else:
        mod = pytest.importorskip("transformers.models.qwen2_vl.modeling_qwen2_vl")
        recompose, section = mod.Qwen2VLRotaryEmbedding.recomposition_frequencies, [4, 6, 6]
    b, h, s, d = 2, 3, 7, 32
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 50, (3, b, s), generator=g)
    inv = rope_inv_freq(d, 1000000.0)
    freqs = pos[..., None].float() * inv  # what the HF module does before recomposing
    fake = types.SimpleNamespace(mrope_section=section)
    cos_hf, sin_hf = recompose(fake, freqs.cos()), recompose(fake, freqs.sin())
    if cos_hf.shape[-1] == d // 2:  # Qwen3-VL's recomposition returns half width; HF duplicates later
        cos_hf, sin_hf = torch.cat((cos_hf, cos_hf), -1), torch.cat((sin_hf, sin_hf), -1)
    q, k = torch.randn(b, h, s, d, generator=g), torch.randn(b, 1, s, d, generator=g)
    want_q, want_k = mod.apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
    cos, sin = rope_cos_sin(pos, inv, mrope_section=section, mrope_interleaved=interleaved_mrope)
    assert cos.shape == (s, b, d // 2)
    torch.testing.assert_close(cos, cos_hf[..., : d // 2].transpose(0, 1), rtol=0, atol=0)
    got_q, got_k = apply_rope(q, k, cos, sin, layout="bhsd", backend="triton")
    assert check.rel_err(got_q, want_q) < 1e-6 and check.rel_err(got_k, want_k) < 1e-6


def test_bad_inputs(interpret):
    q = torch.randn(4, 2, 3, 8)
    cos, sin = rope_cos_sin(torch.arange(4), rope_inv_freq(8))
    with pytest.raises(ValueError, match="layout must be"):
        apply_rope(q, None, cos, sin, layout="bsd")
    with pytest.raises(ValueError, match="cos/sin must be"):
        apply_rope(q, None, cos[:3], sin[:3])
    with pytest.raises(ValueError, match="does not match q"):
        apply_rope(q, torch.randn(4, 2, 3, 6), cos, sin)
    with pytest.raises(ValueError, match="mrope_section"):
        rope_cos_sin(torch.zeros(3, 1, 4), rope_inv_freq(8), mrope_section=[1, 1, 1])
    with pytest.raises(KernelUnsupportedError, match="float64"):
        apply_rope(q.double(), None, cos, sin, backend="triton")
    with pytest.raises(KernelUnsupportedError, match="not contiguous"):
        apply_rope(torch.randn(4, 2, 8, 3).transpose(-1, -2), None, cos, sin, backend="triton")
    out, _ = apply_rope(q.double(), None, cos, sin)  # auto on CPU: the reference, any dtype
    assert out.dtype == torch.float64
