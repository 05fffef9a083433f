"""FP8 numerics (``loong.core.precision``): quantisation, ``fp8_mm``, the FP8 linear, adaptive decisions; the
``@pytest.mark.gpu`` tests run the ``torch._scaled_mm`` paths on the GPU. Model conversion, config and
tensor parallelism are in ``test_fp8_model.py``.

The oracles, on CPU (GEMMs emulated: dequantise, then an fp32 matmul; the same products as ``_scaled_mm``
up to accumulation order):

- quantisation: every element within half an fp8 ulp of its input (subnormals: half the smallest step);
- exactness: operands that are fp8 values times one power of two (with the format's maximum in every
  scale block) quantise exactly, so all three GEMMs of the FP8 linear must equal an fp64 reference to
  fp32 accumulation error; a transposed or mis-routed operand cannot pass this;
- scale orientation: rows spanning six decades keep ~4% error per row under rowwise and blockwise
  scales, while tensorwise (checked to fail the same bound) loses the small rows;
- the native calls' layouts against torch's own meta checks (fake CUDA tensors, no GPU needed);
- error bounds on Gaussian data against fp64, the figures docs/fp8.md documents.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from loong.core.config.schema import PrecisionConfig
from loong.core.errors import LoongError
from loong.core.precision import (
    BLOCKWISE,
    H200_TABLE,
    RECIPES,
    ROWWISE,
    TENSORWISE,
    LinearComm,
    SpeedupTable,
    decide,
    fp8_mm,
    layer_speedup,
    linear_fp8,
    quantize,
)
from loong.core.precision.adaptive import Entry, cache_path, gemm_speedup, gemms, load_cached, save_cached
from loong.core.precision.recipes import E4M3, E5M2, Quantized

FMT = {E4M3: (448.0, 3, -6), E5M2: (57344.0, 2, -14)}  # max, mantissa bits, min normal exponent
# Relative Frobenius error against fp64 on Gaussian data (test_error_bounds_gaussian): the documented bounds.
# Measured (seeded): 3.7% for e4m3 x e4m3 GEMMs, 5.9% where tensorwise's e5m2 gradient is an operand.
BOUNDS = {"tensorwise": {"y": 0.05, "dx": 0.08, "dw": 0.08},
          "rowwise": {"y": 0.05, "dx": 0.05, "dw": 0.05},
          "blockwise": {"y": 0.05, "dx": 0.05, "dw": 0.05}}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _grid(rows: int, cols: int, dtype: torch.dtype, seed: int, pow2: int = 0) -> torch.Tensor:
    """fp8-representable values times ``2**pow2``, with ±max on the diagonals ``(i + j) % 128 == 0``, so that
    every row, column, 1x128 / 128x1 block and 128x128 tile has the format's maximum as its amax."""
    fmax = FMT[dtype][0]
    g = torch.Generator().manual_seed(seed)
    v = (torch.randn(rows, cols, generator=g) * fmax / 8).clamp(-fmax, fmax).to(dtype).float()
    i, j = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    sign = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0)
    v = torch.where((i + j) % 128 == 0, sign * fmax, v)
    return v * 2.0**pow2


# --- quantisation math (loong-kernels' references, float8 dtypes on CPU) ------------------------------
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("gran", ["tensor", "row", "1x128", "128x128"])
def test_quantize_is_within_half_an_ulp(gran: str, fp8_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 300, generator=g) * torch.logspace(-3, 2, 300)  # columns across five decades
    q = quantize(x, gran, fp8_dtype)  # type: ignore[arg-type]
    assert q.data.dtype == fp8_dtype
    back = q.dequantize(torch.float64)
    scale = _elem_scale(q)
    _, mant, min_exp = FMT[fp8_dtype]
    bound = torch.maximum(x.double().abs() * 2.0 ** -(mant + 1), scale * 2.0 ** (min_exp - mant - 1))
    assert bool(((back - x.double()).abs() <= bound * (1 + 1e-6)).all())
    assert float((back - x.double()).abs().max()) > 0  # it does quantise


def _elem_scale(q: Quantized) -> torch.Tensor:
    """The scale that applies to each element of ``q``, as an fp64 matrix."""
    return Quantized(torch.ones_like(q.data, dtype=torch.float32).to(q.data.dtype), q.scale,
                     q.granularity).dequantize(torch.float64)


def test_transposable_granularities_commute_with_transposition() -> None:
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(1))
    for gran in ("tensor", "128x128"):  # the forward's Wq.t() is the dgrad's quantised Wᵀ, bit for bit
        a, b = quantize(w, gran).t(), quantize(w.t().contiguous(), gran)
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
    for gran in ("row", "1x128"):  # these are not, and must be requantised
        with pytest.raises(ValueError, match="not the quantisation of the transpose"):
            quantize(w, gran).t()
        a = quantize(w.t().contiguous(), gran).dequantize()
        b = quantize(w, gran).dequantize().t()
        assert not torch.equal(a, b)


@pytest.mark.parametrize("combo", [("tensor", "tensor"), ("row", "row"), ("1x128", "128x128"), ("1x128", "1x128")])
def test_fp8_mm_is_exact_on_representable_operands(combo: tuple[str, str]) -> None:
    a, b = _grid(256, 384, E4M3, 0, -9), _grid(128, 384, E4M3, 1, -7)
    qa, qb = quantize(a, combo[0]), quantize(b, combo[1])  # type: ignore[arg-type]
    assert torch.equal(qa.dequantize(), a) and torch.equal(qb.dequantize(), b)
    out = fp8_mm(qa, qb, torch.float32, native=False)
    assert _rel(out, a.double() @ b.double().t()) < 1e-6


@pytest.mark.parametrize("combo", [("tensor", "tensor"), ("row", "row"), ("1x128", "128x128"), ("1x128", "1x128")])
def test_native_calls_pass_torchs_layout_checks(combo: tuple[str, str]) -> None:
    """The ``_scaled_mm`` / ``scaled_mm`` calls as built for the GPU (row-major A, column-major B, scale shapes
    and strides, 128x128 scales padded to 4 K-blocks) against torch's own checks: fake CUDA tensors run
    torch's meta functions without a GPU. What the kernels compute is checked on the GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from loong.core.precision.fp8_linear import _scaled_mm

    def fake(rows: int, cols: int, gran: str, dtype: torch.dtype = E4M3) -> Quantized:
        shape = {"tensor": (), "row": (rows, 1), "1x128": (rows, -(-cols // 128)),
                 "128x128": (-(-rows // 128), -(-cols // 128))}[gran]
        return Quantized(torch.empty(rows, cols, dtype=dtype, device="cuda"), torch.empty(shape, device="cuda"), gran)

    with FakeTensorMode():
        for m, n, k in ((4096, 3072, 2048), (3072, 2048, 4096), (512, 768, 256)):
            out = _scaled_mm(fake(m, k, combo[0], E5M2 if combo[0] == "tensor" else E4M3), fake(n, k, combo[1]),
                             torch.bfloat16, False)
            assert out.shape == (m, n) and out.dtype == torch.bfloat16


# --- the FP8 linear ----------------------------------------------------------------------------------
def _run(recipe, x, w, dy, bias=None, comm=None):  # noqa: ANN001, ANN202
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    b = None if bias is None else bias.clone().requires_grad_(True)
    y = linear_fp8(x, w, b, recipe, comm, native=False)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("recipe", [TENSORWISE, ROWWISE, BLOCKWISE], ids=lambda r: r.name)
def test_fp8_linear_is_exact_on_representable_operands(recipe) -> None:  # noqa: ANN001
    """Forward, dgrad and wgrad all equal fp64 when every operand quantises exactly."""
    m, n, k = 256, 384, 512
    x = _grid(m, k, E4M3, 2, -8).view(2, m // 2, k)  # [s, b, h] as megatron passes it
    w = _grid(n, k, E4M3, 3, -10)
    dy = _grid(m, n, recipe.grad_dtype, 4, -20).view(2, m // 2, n)
    y, dx, dw, _ = _run(recipe, x, w, dy)
    x2, dy2 = x.double().reshape(m, k), dy.double().reshape(m, n)
    assert y.shape == (2, m // 2, n) and dx.shape == x.shape
    assert _rel(y.reshape(m, n), x2 @ w.double().t()) < 1e-6
    assert _rel(dx.reshape(m, k), dy2 @ w.double()) < 1e-6
    assert _rel(dw, dy2.t() @ x2) < 1e-6


@pytest.mark.parametrize("recipe", [TENSORWISE, ROWWISE, BLOCKWISE], ids=lambda r: r.name)
def test_a_token_count_off_the_kernel_multiple_is_padded_for_the_native_gemms(recipe, monkeypatch) -> None:  # noqa: ANN001
    """37 tokens: the weight-gradient GEMM contracts over them, and ``_scaled_mm`` needs a multiple of 16 (128
    with block scales; with block scales the forward and dgrad GEMMs also need their 37 rows a multiple of 16).
    The native path pads those operands with zero tokens, so every GEMM it would send to the GPU passes the
    layout rule, and the output and gradients are those of the unpadded emulation."""
    import loong.core.precision.fp8_linear as fl

    g = torch.Generator().manual_seed(7)
    m, n, k = 37, 256, 384
    x, w, dy = torch.randn(m, k, generator=g), 0.02 * torch.randn(n, k, generator=g), 1e-3 * torch.randn(m, n, generator=g)
    ref = _run(recipe, x, w, dy)  # native=False: nothing padded
    shapes: list[bool] = []
    real_mm = fl.fp8_mm

    def spy(a, b, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        shapes.append(fl._native_shape_ok(a, b))
        return real_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(fl, "fp8_mm", spy)
    xp, wp = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = fl.linear_fp8(xp, wp, None, recipe, native=True)
    y.backward(dy)
    assert len(shapes) == 3 and all(shapes), shapes
    assert y.shape == (m, n) and _rel(y.detach(), ref[0]) < 1e-6
    assert _rel(xp.grad, ref[1]) < 1e-6 and _rel(wp.grad, ref[2]) < 1e-6
    dyq = quantize(dy, recipe.grad, recipe.grad_dtype) if recipe.grad == "tensor" else None
    xq = quantize(x, recipe.activation, recipe.fwd_dtype) if recipe.activation == "tensor" else None
    a, b = fl._wgrad_operands(dy, dyq, None if xq is not None else x, xq, recipe, pad=True)
    assert a.data.shape[1] % 16 == 0 and b.data.shape[1] == a.data.shape[1] and fl._native_shape_ok(a, b)


@pytest.mark.parametrize("recipe", [TENSORWISE, ROWWISE, BLOCKWISE], ids=lambda r: r.name)
def test_error_bounds_gaussian(recipe) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(5)
    m, n, k = 512, 384, 640
    x, w, dy = torch.randn(m, k, generator=g), 0.02 * torch.randn(n, k, generator=g), 1e-3 * torch.randn(m, n, generator=g)
    bias = torch.randn(n, generator=g)
    y, dx, dw, db = _run(recipe, x, w, dy, bias)
    xd, wd, dyd = x.double(), w.double(), dy.double()
    err = {"y": _rel(y - bias, xd @ wd.t()), "dx": _rel(dx, dyd @ wd), "dw": _rel(dw, dyd.t() @ xd)}
    print(f"\n{recipe.name}: " + ", ".join(f"{key} {v:.4f}" for key, v in err.items()))
    assert _rel(db, dyd.sum(0)) < 1e-6  # bias gradient stays in high precision
    for key, v in err.items():
        assert 1e-3 < v < BOUNDS[recipe.name][key], (key, v)


def test_row_scales_follow_the_rows() -> None:
    """Rows of X (and of dY) across six decades: per-row error stays small only if scales follow the rows."""
    g = torch.Generator().manual_seed(6)
    m, n, k = 256, 256, 384
    rows = torch.logspace(-3, 3, m).unsqueeze(1)
    x, w = torch.randn(m, k, generator=g) * rows, torch.randn(n, k, generator=g)
    dy = torch.randn(m, n, generator=g) * rows
    ref_y, ref_dx = x.double() @ w.double().t(), dy.double() @ w.double()

    def worst_row(a: torch.Tensor, ref: torch.Tensor) -> float:
        return float(((a.double() - ref).norm(dim=1) / ref.norm(dim=1)).max())

    worst = {}
    for recipe in (TENSORWISE, ROWWISE, BLOCKWISE):
        y, dx, _, _ = _run(recipe, x, w, dy)
        worst[recipe.name] = (worst_row(y, ref_y), worst_row(dx, ref_dx))
    for name in ("rowwise", "blockwise"):
        assert max(worst[name]) < 0.06, worst
    assert min(worst["tensorwise"]) > 0.06, worst  # the bound has teeth: one scale loses the small rows


def test_tensorwise_gradients_keep_their_range_in_e5m2() -> None:
    """One scale for a whole gradient: rows 2^-24 below the largest survive only in e5m2's range
    (e4m3's smallest step is 2^-17.8 of its maximum)."""
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(128, 128, generator=g), torch.randn(64, 128, generator=g)
    dy = torch.randn(128, 64, generator=g) * torch.logspace(-24, 0, 128, base=2).unsqueeze(1)
    _, dx, _, _ = _run(TENSORWISE, x, w, dy)
    ref = dy.double() @ w.double()
    worst = float(((dx.double() - ref).norm(dim=1) / ref.norm(dim=1)).max())
    assert worst < 0.15, worst


def test_frozen_weight_and_no_input_grad() -> None:
    g = torch.Generator().manual_seed(7)
    x, w, dy = torch.randn(64, 128, generator=g), torch.randn(32, 128, generator=g), torch.randn(64, 32, generator=g)
    xr = x.clone().requires_grad_(True)
    linear_fp8(xr, w, None, ROWWISE, native=False).backward(dy)  # LoRA's frozen base weight
    assert _rel(xr.grad, dy.double() @ w.double()) < 0.06
    wr = w.clone().requires_grad_(True)
    linear_fp8(x, wr, None, ROWWISE, native=False).backward(dy)
    assert _rel(wr.grad, dy.double().t() @ x.double()) < 0.06


def test_gradient_accumulation_fusion_adds_to_main_grad() -> None:
    g = torch.Generator().manual_seed(8)
    x, dy = torch.randn(64, 128, generator=g), torch.randn(64, 32, generator=g)
    w = torch.randn(32, 128, generator=g).requires_grad_(True)
    w.main_grad = torch.ones(32, 128)
    linear_fp8(x, w, None, TENSORWISE, LinearComm(gradient_accumulation_fusion=True), native=False).backward(dy)
    assert w.grad is None  # handed to main_grad, as megatron's fused path does
    assert _rel(w.main_grad - 1, dy.double().t() @ x.double()) < 0.12
    w.grad_added_to_main_grad = False  # megatron DDP's flag: a placeholder grad, flag set
    linear_fp8(x, w, None, TENSORWISE, LinearComm(gradient_accumulation_fusion=True), native=False).backward(dy)
    assert w.grad_added_to_main_grad and w.grad is not None and w.grad.shape == w.shape


# --- adaptive decisions on given tables ---------------------------------------------------------------
def _probed(recipe: str, speedups: dict[str, float], m: int, n: int, k: int) -> list[Entry]:
    return [Entry(recipe, kind, *gemms(m, n, k)[kind], s, True) for kind, s in speedups.items()]


def test_layer_speedup_combines_its_three_gemms() -> None:
    table = SpeedupTable("GPU", "test", _probed("tensorwise", {"fwd": 2.0, "dgrad": 1.0, "wgrad": 1.0}, 4096, 1024, 512))
    assert layer_speedup(table, TENSORWISE, 4096, 1024, 512) == pytest.approx(3 / (0.5 + 1 + 1))  # time-weighted
    assert decide(table, TENSORWISE, 4096, 1024, 512, 1.2).fp8
    assert not decide(table, TENSORWISE, 4096, 1024, 512, 1.21).fp8
    assert decide(table, TENSORWISE, 4096, 1024, 512, 1.2).reason == "est. 1.20x >= 1.2x"


def test_missing_recipe_keeps_bf16_and_probed_entries_win() -> None:
    table = SpeedupTable("GPU", "test", [*_probed("tensorwise", dict.fromkeys(("fwd", "dgrad", "wgrad"), 1.5),
                                                  8192, 4096, 4096),
                                         Entry("tensorwise", "any", 8192, 4096, 4096, 3.0, False)])
    d = decide(table, ROWWISE, 8192, 4096, 4096, 1.1)
    assert not d.fp8 and d.speedup is None and "no rowwise measurement" in d.reason
    assert layer_speedup(table, TENSORWISE, 8192, 4096, 4096) == pytest.approx(1.5)  # exact probed matches
    assert layer_speedup(table, TENSORWISE, 1024, 4096, 4096) == pytest.approx(1.5)  # interpolated: probed only


def test_interpolation_is_linear_in_log_volume_and_clamped() -> None:
    table = SpeedupTable("GPU", "test", [Entry("rowwise", "fwd", 1024, 1024, 1024, 1.0, True),
                                         Entry("rowwise", "fwd", 4096, 4096, 4096, 2.0, True)])
    assert gemm_speedup(table, ROWWISE, "fwd", 2048, 2048, 2048) == pytest.approx(1.5)
    assert gemm_speedup(table, ROWWISE, "wgrad", 4096, 1024, 1024) == pytest.approx(1 + 2 / 6)
    assert gemm_speedup(table, ROWWISE, "fwd", 64, 64, 64) == 1.0
    assert gemm_speedup(table, ROWWISE, "fwd", 65536, 8192, 8192) == 2.0


def test_shipped_h200_table_adds_quantisation_and_picks_the_big_layers() -> None:
    """GEMM-only speedups (1.65x / 1.17x) lose the modelled quantisation time: 4096x2048x2048 drops below 1."""
    small = gemm_speedup(H200_TABLE, TENSORWISE, "fwd", 4096, 2048, 2048)
    t = 2 * 4096 * 2048 * 2048 / 650e12
    q = (4096 * 2048 + 2048 * 2048) / (4249e9 * 0.43 / 3)
    assert small == pytest.approx(t / (t / 1.17 + q)) and small < 1.0
    assert 1.2 < gemm_speedup(H200_TABLE, TENSORWISE, "fwd", 16384, 4096, 14336) < 1.65
    # a 1.24B LLaMA at 16K tokens per micro-batch: the MLP pays, attention's 2048-wide projections do not
    fp8 = {name: decide(H200_TABLE, TENSORWISE, 16384, n, k, 1.1).fp8
           for name, (n, k) in {"qkv": (3072, 2048), "proj": (2048, 2048), "fc1": (16384, 2048),
                                "fc2": (2048, 8192)}.items()}
    assert fp8 == {"qkv": False, "proj": False, "fc1": True, "fc2": True}
    assert not decide(H200_TABLE, ROWWISE, 16384, 16384, 2048, 1.1).fp8  # nothing shipped for rowwise


def test_table_json_cache_and_explicit_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loong.core.precision import table_for

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    table = SpeedupTable("NVIDIA H200 (test)", "test", _probed("blockwise", {"fwd": 1.3}, 128, 256, 512),
                         torch_version=torch.__version__)
    assert SpeedupTable.from_json(table.to_json()) == table
    path = save_cached(table)
    assert path == tmp_path / "loong" / "fp8" / "NVIDIA_H200_test.json" == cache_path(table.gpu)
    assert load_cached(table.gpu) == table
    path.write_text(json.dumps({**json.loads(table.to_json()), "torch": "0.0"}))
    assert load_cached(table.gpu) is None  # probed under another torch: stale
    assert table_for([], BLOCKWISE, "cpu", path=str(path)).entries == table.entries
    with pytest.raises(LoongError, match="does not exist"):
        table_for([], BLOCKWISE, "cpu", path=str(tmp_path / "nope.json"))
    assert table_for([(64, 64, 64)], TENSORWISE, "cpu").entries == []  # no GPU: nothing probed or shipped


def test_probe_needs_a_gpu() -> None:
    from loong.core.precision import probe

    with pytest.raises(LoongError, match="on a GPU"):
        probe([("fwd", 64, 64, 64)], TENSORWISE, "cpu")


def test_recipes_table() -> None:
    assert set(RECIPES) == {"tensorwise", "rowwise", "blockwise"}
    assert (TENSORWISE.grad_dtype, ROWWISE.grad_dtype, BLOCKWISE.grad_dtype) == (E5M2, E4M3, E4M3)
    assert (BLOCKWISE.activation, BLOCKWISE.weight, BLOCKWISE.grad) == ("1x128", "128x128", "1x128")
    assert math.isclose(PrecisionConfig().fp8_adaptive_threshold, 1.1)


# --- on the GPU (pytest -m gpu): the torch._scaled_mm paths ------------------------------------------------
def _cuda() -> torch.device:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.fail("fp8 gpu tests need an NVIDIA GPU of compute capability 8.9 or newer")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [TENSORWISE, ROWWISE, BLOCKWISE], ids=lambda r: r.name)
def test_gpu_native_gemms_match_emulation(recipe) -> None:  # noqa: ANN001
    """Each of the recipe's three GEMMs through _scaled_mm equals the fp32 emulation of the same fp8
    operands up to accumulation order and the bf16 output rounding, without falling back."""
    import warnings

    from loong.core.precision import native_support
    from loong.core.precision.adaptive import _operands

    dev = _cuda()
    support = native_support(dev)
    print(f"\nnative support on {torch.cuda.get_device_name()}: {support}")
    if recipe is BLOCKWISE:  # torch 2.11: cuBLAS >= 12.9 on sm90 only
        assert support["blockwise_fwd"] and support["blockwise_wgrad"], support
    g = torch.Generator(device=dev).manual_seed(0)
    for kind, (m, n, k) in gemms(4096, 3072, 2048).items():
        (ga, da), (gb, db) = _operands(recipe, kind)
        a = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
        b = 0.02 * torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16)
        qa, qb = quantize(a, ga, da), quantize(b, gb, db)
        fast = kind == "fwd" and recipe.fast_accum_forward
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            native = fp8_mm(qa, qb, torch.bfloat16, fast_accum=fast)
        assert not [w for w in caught if "emulated" in str(w.message)], "fell back to emulation"
        emulated = fp8_mm(qa, qb, torch.float32, native=False, emulate_dtype=torch.float32)
        err = _rel(native, emulated)
        print(f"{recipe.name} {kind} {m}x{n}x{k}: native vs emulated {err:.2e}")
        assert err < (1e-2 if fast else 4e-3), (kind, err)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [TENSORWISE, ROWWISE, BLOCKWISE], ids=lambda r: r.name)
def test_gpu_fp8_linear_within_bounds(recipe) -> None:  # noqa: ANN001
    """Forward and both gradients on a realistic shape, against fp64: within the documented CPU bounds
    (plus bf16 output rounding), and bf16's own error for comparison."""
    dev = _cuda()
    g = torch.Generator(device=dev).manual_seed(1)
    m, n, k = 8192, 4096, 2048
    x = torch.randn(m, k, device=dev, generator=g).bfloat16().requires_grad_(True)
    w = (0.02 * torch.randn(n, k, device=dev, generator=g)).bfloat16().requires_grad_(True)
    dy = (1e-3 * torch.randn(m, n, device=dev, generator=g)).bfloat16()
    y = linear_fp8(x, w, None, recipe)
    y.backward(dy)
    xd, wd, dyd = x.detach().double(), w.detach().double(), dy.double()
    err = {"y": _rel(y.detach(), xd @ wd.t()), "dx": _rel(x.grad, dyd @ wd), "dw": _rel(w.grad, dyd.t() @ xd)}
    print(f"\n{recipe.name} on GPU: " + ", ".join(f"{key} {v:.4f}" for key, v in err.items()))
    for key, v in err.items():
        assert v < BOUNDS[recipe.name][key] + 0.005, (key, v)


@pytest.mark.gpu
def test_gpu_probe_caches_per_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loong.core.precision import table_for

    dev = _cuda()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lines: list[str] = []
    table = table_for([(16384, 14336, 4096), (4096, 2048, 2048)], TENSORWISE, dev, echo=lines.append)
    path = cache_path(torch.cuda.get_device_name())
    assert path.is_file() and len(table.entries) == 6 and "probed 6" in lines[0]
    for e in table.entries:
        print(f"\n{e.kind} {e.m}x{e.n}x{e.k}: bf16 {e.bf16_ms:.3f} ms, fp8+quant {e.fp8_ms:.3f} ms -> {e.speedup:.2f}x")
        # small GEMMs are launch-bound once quantisation is counted (0.25x measured at 4096x2048x2048): the
        # bounds only catch a broken timing, the ordering below is the real check
        assert e.includes_quantization and 0.05 < e.speedup < 3
    again: list[str] = []
    assert table_for([(4096, 2048, 2048)], TENSORWISE, dev, echo=again.append).entries == table.entries
    assert again == []  # served from the cache
    big = layer_speedup(table, TENSORWISE, 16384, 14336, 4096)
    assert big is not None and big > layer_speedup(table, TENSORWISE, 4096, 2048, 2048)  # type: ignore[operator]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise", "blockwise", "adaptive"])
def test_gpu_fp8_training_follows_bf16(fp8: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``loong-llm train precision.fp8=...`` (the tiny preset, 40 steps) lowers the loss like bf16 does."""
    from loong.llm.cli import main

    _cuda()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def losses(name: str, *extra: str) -> list[float]:
        code = main(["train", "train.steps=40", "train.progress=false", f"output_dir={tmp_path}", f"run_name={name}",
                     "train.eval_interval=0", "train.eval_iters=0", "train.save_final=false", *extra])
        assert code == 0
        recs = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [r["train_loss"] for r in recs if "train_loss" in r]

    ref, got = losses("bf16"), losses("fp8", f"precision.fp8={fp8}")
    print(f"\n{fp8}: loss {got[0]:.4f} -> {got[-1]:.4f}; bf16 {ref[0]:.4f} -> {ref[-1]:.4f}")
    assert got[-1] < 0.9 * got[0]
    assert abs(got[-1] - ref[-1]) < 0.03 * ref[-1]
