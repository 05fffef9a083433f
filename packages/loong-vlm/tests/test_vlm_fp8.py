"""``precision.fp8`` on the tiny VLM (megatron engine, one process), on a CPU accelerator that claims the ``fp8``
capability (a test double: its FP8 GEMMs emulate): the foundation's megatron linear layers convert, the run trains
in bf16 and its losses follow the bf16 run's; ``precision.fp8_output_layer`` reaches the foundation's hook.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from vlm_layouts import build  # noqa: E402

from loong.core.accelerators.cpu import CPUAccelerator  # noqa: E402
from loong.core.engines.megatron.engine import MegatronEngine  # noqa: E402
from loong.core.engines.megatron.layout import shutdown_distributed  # noqa: E402
from loong.core.engines.megatron.state import unwrap  # noqa: E402
from loong.core.errors import LoongError  # noqa: E402


class FP8OnCPU(CPUAccelerator):
    def __init__(self, extra: set[str]) -> None:
        super().__init__()
        self.extra = extra

    def capabilities(self) -> set[str]:
        return super().capabilities() | self.extra


def _run(root: Path, overrides: list[str], extra: set[str] = frozenset({"fp8"})) -> tuple[list[float], dict, str, bool]:
    """Three bf16 steps; (losses, linear layer name -> class name, the engine's log, whether the foundation's loss
    runs in FP8)."""
    acc = FP8OnCPU(set(extra))
    log = io.StringIO()
    try:
        with acc.activate(engine="megatron"), contextlib.redirect_stdout(log), contextlib.redirect_stderr(io.StringIO()):
            cfg, layout, task = build(root, ["train.precision=bf16", *overrides], acc, steps=3)
            engine = MegatronEngine(task, cfg, acc, layout)
            losses = [engine.train_step(step).loss for step in range(3)]
            model = unwrap(engine.model_chunks[0])
            classes = {n: type(m).__name__ for n, m in model.named_modules() if "Linear" in type(m).__name__}
            return losses, classes, log.getvalue(), model.foundation.fp8_output_layer
    finally:
        shutdown_distributed()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vlm_fp8")


def test_fp8_converts_the_foundation_and_trains_like_bf16(root: Path) -> None:
    ref, ref_classes, _, _ = _run(root, [])
    got, classes, log, fp8_loss = _run(root, ["precision.fp8=tensorwise"])
    assert "fp8: 16 of 17 linear layers run in fp8" in log  # tiny foundation: 4 layers x 4, the output layer kept
    assert "  foundation.output_layer x1: bf16 (output layer)" in log and not fp8_loss
    fp8 = {n for n, c in classes.items() if c.startswith("FP8")}
    assert len(fp8) == 16 and all(n.startswith("foundation.decoder.") for n in fp8)
    assert not any(c.startswith("FP8") for c in ref_classes.values())
    # the encoder's and projector's layers are plain nn.Linear, which the megatron engine's FP8 leaves as they are
    assert {classes[n] for n in classes if n.startswith(("encoder.", "projector."))} == {"Linear"}
    assert got != ref and got[-1] < got[0]
    for a, b in zip(got, ref, strict=True):  # measured within 0.01% step by step
        assert abs(a - b) < 2e-3 * b, (got, ref)


def test_fp8_output_layer_reaches_the_foundation(root: Path) -> None:
    """The VLM chunk hands ``precision.fp8_output_layer`` to its foundation's hook (loong-llm's, tested with the FP8
    loss running in ``test_fp8_model.py``): here the foundation's loss is unfused, and the foundation says so."""
    with pytest.raises(LoongError, match="precision.fp8_output_layer=true: it needs the fused linear . cross-entropy"):
        _run(root, ["precision.fp8=tensorwise", "precision.fp8_output_layer=true"])
