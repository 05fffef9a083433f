"""Adaptive FP8: per linear layer, FP8 only where its GEMMs measurably run faster than bf16.

An FP8 GEMM is not always faster: on the H200 it was measured at 1.65–1.9x bf16 at
16384x4096x14336-class shapes but only 1.17x at 4096x2048x2048, *before* the quantisation of its operands,
which small GEMMs do not amortise. The decision therefore comes from a table of speedups
``(recipe, gemm kind, M, N, K) -> t_bf16 / t_fp8``:

- **probed** (:func:`probe`): on the GPU, each GEMM shape of the model is timed once in bf16 and as
  "quantise both operands + fp8 GEMM"; the table is cached per GPU model in
  ``~/.cache/loong/fp8/<gpu>.json`` (``$XDG_CACHE_HOME`` respected) and reused while torch's version is the same;
- **shipped** (:data:`H200_TABLE`): the two GEMM-only measurements above, for tensorwise on the H200.
  GEMM-only entries get the quantisation cost added by a model (:func:`quantization_seconds`) built
  on measured H200 figures (docs/kernels.md): 4249 GB/s copy bandwidth, the quantisation kernels'
  fraction of it, bf16 GEMMs at about 650 TFLOP/s.

A layer's speedup combines its three GEMMs (forward, input gradient, weight gradient; same FLOPs
each): ``3 / sum(1 / s_i)``. Shapes missing from the table are interpolated in log(M·N·K) between the
entries of the recipe (clamped at the ends); a recipe with no entries gives no speedup, and the layer
stays bf16.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from loong.core.errors import LoongError
from loong.core.precision.recipes import FP8Recipe, quantize

KINDS = ("fwd", "dgrad", "wgrad")
# H200 figures measured by benchmarks/kernels.py (docs/kernels.md): copy bandwidth (read + write), each
# quantiser's fraction of it at 3 bytes per element (read bf16, write fp8), and the bf16 GEMM rate of the
# cross-entropy kernel's GEMMs (624-680 TFLOP/s).
H200_COPY_BYTES_PER_S = 4249e9
H200_QUANT_FRACTION = {"tensor": 0.43, "row": 0.66, "1x128": 0.64, "128x128": 0.49}
H200_BF16_FLOPS = 650e12


@dataclass(frozen=True)
class Entry:
    """One measured GEMM: ``speedup = t_bf16 / t_fp8`` of an ``[m, k] x [k, n]`` product.

    ``includes_quantization``: ``t_fp8`` includes quantising both operands from bf16 (probed entries);
    otherwise it is the fp8 GEMM alone (``kind`` is then ``any``).
    """

    recipe: str
    kind: str
    m: int
    n: int
    k: int
    speedup: float
    includes_quantization: bool
    bf16_ms: float | None = None
    fp8_ms: float | None = None


@dataclass
class SpeedupTable:
    """Measured speedups for one GPU model."""

    gpu: str
    source: str
    entries: list[Entry] = field(default_factory=list)
    torch_version: str = ""

    def to_json(self) -> str:
        """The table as JSON (the cache file's format)."""
        return json.dumps({"gpu": self.gpu, "source": self.source, "torch": self.torch_version,
                           "entries": [asdict(e) for e in self.entries]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> SpeedupTable:
        """Parse :meth:`to_json`'s output."""
        d = json.loads(text)
        return cls(d["gpu"], d.get("source", ""), [Entry(**e) for e in d["entries"]], d.get("torch", ""))

    def find(self, recipe: str, kind: str, m: int, n: int, k: int) -> Entry | None:
        """The entry measured at exactly this GEMM, if any."""
        for e in self.entries:
            if (e.recipe, e.m, e.n, e.k) == (recipe, m, n, k) and e.kind in (kind, "any"):
                return e
        return None


H200_TABLE = SpeedupTable(
    gpu="NVIDIA H200",
    source="issue 7: bf16 vs fp8 (tensorwise) GEMM alone, measured on the H200 before filing: 1.65-1.9x at "
           "16384x4096x14336-class shapes (the low end is kept), 1.17x at 4096x2048x2048",
    entries=[Entry("tensorwise", "any", 16384, 4096, 14336, 1.65, False),
             Entry("tensorwise", "any", 4096, 2048, 2048, 1.17, False)],
)


def gemms(m: int, n: int, k: int) -> dict[str, tuple[int, int, int]]:
    """The (M, N, K) of a linear layer's three GEMMs for ``m`` tokens, ``n`` outputs, ``k`` inputs."""
    return {"fwd": (m, n, k), "dgrad": (m, k, n), "wgrad": (n, k, m)}


def _operands(recipe: FP8Recipe, kind: str) -> tuple[tuple[str, torch.dtype], tuple[str, torch.dtype]]:
    """(granularity, fp8 dtype) of A and B in GEMM ``kind`` (see :mod:`~loong.core.precision.recipes`)."""
    act, wt, grad = ((recipe.activation, recipe.fwd_dtype), (recipe.weight, recipe.fwd_dtype),
                     (recipe.grad, recipe.grad_dtype))
    return {"fwd": (act, wt), "dgrad": (grad, wt), "wgrad": (grad, act)}[kind]


def quantization_seconds(recipe: FP8Recipe, kind: str, m: int, n: int, k: int) -> float:
    """Modelled H200 time to quantise both operands of an ``m x n x k`` GEMM (A [m, k], B [n, k])."""
    (ga, _), (gb, _) = _operands(recipe, kind)
    rate = {g: H200_COPY_BYTES_PER_S * f / 3 for g, f in H200_QUANT_FRACTION.items()}  # elements / s
    return m * k / rate[ga] + n * k / rate[gb]


def _with_quantization(recipe: FP8Recipe, kind: str, m: int, n: int, k: int, gemm_speedup: float) -> float:
    t_bf16 = 2 * m * n * k / H200_BF16_FLOPS
    return t_bf16 / (t_bf16 / gemm_speedup + quantization_seconds(recipe, kind, m, n, k))


def _interpolate(entries: list[Entry], m: int, n: int, k: int) -> float:
    pts = sorted((math.log(e.m * e.n * e.k), e.speedup) for e in entries)
    x = math.log(m * n * k)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def gemm_speedup(table: SpeedupTable, recipe: FP8Recipe, kind: str, m: int, n: int, k: int) -> float | None:
    """``t_bf16 / t_fp8`` of one GEMM, quantisation included; None when the table has nothing for the recipe."""
    exact = table.find(recipe.name, kind, m, n, k)
    if exact is not None:
        if exact.includes_quantization:
            return exact.speedup
        return _with_quantization(recipe, kind, m, n, k, exact.speedup)
    mine = [e for e in table.entries if e.recipe == recipe.name]
    probed = [e for e in mine if e.includes_quantization]
    if probed:  # measurements with quantisation win over GEMM-only ones
        return _interpolate(probed, m, n, k)
    if mine:
        return _with_quantization(recipe, kind, m, n, k, _interpolate(mine, m, n, k))
    return None


def layer_speedup(table: SpeedupTable, recipe: FP8Recipe, m: int, n: int, k: int) -> float | None:
    """Speedup of a linear layer's forward + backward (its three GEMMs, equal FLOPs each)."""
    speedups = [gemm_speedup(table, recipe, kind, *shape) for kind, shape in gemms(m, n, k).items()]
    if any(s is None for s in speedups):
        return None
    return len(speedups) / sum(1.0 / s for s in speedups)  # type: ignore[operator]


@dataclass(frozen=True)
class Decision:
    """Whether one layer runs in fp8, and why."""

    fp8: bool
    speedup: float | None
    reason: str


def decide(table: SpeedupTable, recipe: FP8Recipe, m: int, n: int, k: int, threshold: float) -> Decision:
    """FP8 where the layer's estimated speedup (quantisation included) is at least ``threshold``."""
    s = layer_speedup(table, recipe, m, n, k)
    if s is None:
        return Decision(False, None, f"no {recipe.name} measurement in the {table.gpu} table")
    verdict = ">=" if s >= threshold else "<"
    return Decision(s >= threshold, s, f"est. {s:.2f}x {verdict} {threshold:g}x")


# --- probing and the per-GPU cache ------------------------------------------------------------------

def cache_path(gpu: str) -> Path:
    """``$XDG_CACHE_HOME/loong/fp8/<gpu>.json`` (``~/.cache`` by default)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "loong" / "fp8" / (re.sub(r"[^A-Za-z0-9._-]+", "_", gpu).strip("_") + ".json")


def load_cached(gpu: str) -> SpeedupTable | None:
    """The cached table for ``gpu`` if it was probed with this torch version."""
    path = cache_path(gpu)
    if not path.is_file():
        return None
    try:
        table = SpeedupTable.from_json(path.read_text())
    except (ValueError, KeyError, TypeError):
        return None  # a damaged cache is re-probed
    return table if table.torch_version == torch.__version__ else None


def save_cached(table: SpeedupTable) -> Path:
    """Write ``table`` to its cache file atomically (ranks on one host may race)."""
    path = cache_path(table.gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(table.to_json())
    tmp.replace(path)
    return path


def _time_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def probe(gemm_shapes: Iterable[tuple[str, int, int, int]], recipe: FP8Recipe, device: torch.device | str,
          warmup: int = 3, reps: int = 10) -> list[Entry]:
    """Time each ``(kind, M, N, K)`` GEMM on ``device`` in bf16 and as quantise-both + fp8 GEMM.

    The fp8 side quantises from bf16 with loong-kernels' kernels and multiplies through
    :func:`~loong.core.precision.fp8_linear.fp8_mm` (emulated where the device lacks a native kernel, which
    then shows as a speedup below 1). Medians of ``reps`` timed runs, CUDA events.
    """
    from loong.core.precision.fp8_linear import fp8_mm

    device = torch.device(device)
    if device.type != "cuda":
        raise LoongError(f"the fp8 probe times GEMMs on a GPU; {device} is not one")
    out = []
    g = torch.Generator(device=device).manual_seed(0)
    for kind, m, n, k in gemm_shapes:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
        b = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g)
        (ga, da), (gb, db) = _operands(recipe, kind)
        fast = recipe.fast_accum_forward and kind == "fwd"
        bf16 = _time_ms(lambda a=a, b=b: a @ b.t(), warmup, reps)
        fp8 = _time_ms(lambda a=a, b=b, ga=ga, gb=gb, da=da, db=db, fast=fast: fp8_mm(
            quantize(a, ga, da), quantize(b, gb, db), torch.bfloat16, fast_accum=fast), warmup, reps)
        out.append(Entry(recipe.name, kind, m, n, k, bf16 / fp8, True, bf16, fp8))
        del a, b
    return out


def table_for(layer_shapes: Iterable[tuple[int, int, int]], recipe: FP8Recipe, device: torch.device | str,
              *, probe_missing: bool = True, path: str | None = None,
              echo: Callable[[str], None] | None = None) -> SpeedupTable:
    """The table that adaptive FP8 decides from for layers of ``(tokens, out, in)`` shapes.

    ``path`` names a JSON table to use as is. Otherwise the GPU's cached table, completed by probing the
    missing GEMMs when ``probe_missing`` and saved back; without probing, the cache plus the shipped table
    of the same GPU model (the H200's), or an empty table.
    """
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise LoongError(f"precision.fp8_table: {path} does not exist")
        try:
            return SpeedupTable.from_json(p.read_text())
        except (ValueError, KeyError, TypeError) as exc:
            raise LoongError(f"precision.fp8_table: {path} is not a speedup table ({exc})") from None
    device = torch.device(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    table = load_cached(gpu) or SpeedupTable(gpu, "probed by loong.core.precision.adaptive.probe",
                                             torch_version=torch.__version__)
    needed = sorted({(kind, *shape) for s in layer_shapes for kind, shape in gemms(*s).items()})
    missing = [s for s in needed if table.find(recipe.name, *s) is None]
    if missing and probe_missing and device.type == "cuda":
        started = time.perf_counter()
        table.entries.extend(probe(missing, recipe, device))
        where = save_cached(table)
        if echo:
            echo(f"fp8: probed {len(missing)} {recipe.name} GEMM shapes in {time.perf_counter() - started:.1f} s "
                 f"-> {where}")
    elif missing and "H200" in gpu:
        table.entries.extend(H200_TABLE.entries)
        table.source += "; " + H200_TABLE.source
    return table

