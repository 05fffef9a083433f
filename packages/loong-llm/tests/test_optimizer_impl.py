"""``train.optimizer_impl``: torch AdamW's fused kernel against its foreach path inside megatron-core's optimiser.

On the CPU (where torch also has a fused AdamW) the engine is built both ways on the tiny preset: the fused one must
really be fused (every group's flags; each ``step`` an fp32 tensor on the parameter's device), train to the same
losses, and take a checkpoint written by the other implementation. ``auto`` follows the accelerator (the CUDA
plugin picks fused). Bit-exact resume with the fused kernel is in test_fault_tolerance (layout ``tp1-fused``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from loong.core.accelerators.cpu import CPUAccelerator
from loong.core.config import compose_config
from loong.core.engines.megatron import MegatronEngine
from loong.core.errors import LoongError
from loong.core.parallel import init_distributed, shutdown_distributed
from loong.llm.pretrain import PretrainTask
from loong.llm.schema import LLMRunConfig

SETTINGS = ["train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2", "train.lr=1e-2",
            "train.warmup_steps=0", "model.fused_kernels=off"]


class PrefersFused(CPUAccelerator):
    """A CPU accelerator that asks for the fused AdamW, as the CUDA plugin does."""

    def adam_implementation(self) -> str:
        return "fused"


def _run(acc: CPUAccelerator, impl: str, steps: int, save: Path | None = None, load: Path | None = None,
         extra: tuple[str, ...] = (), grad_dtypes: set | None = None):
    cfg, _ = compose_config("loong.llm.configs", "pretrain", [*SETTINGS, f"train.optimizer_impl={impl}", *extra],
                            LLMRunConfig)
    with acc.activate():
        layout = init_distributed(acc, cfg.parallel)
        try:
            acc.manual_seed(cfg.train.seed)  # as loong.core.run seeds a run: both engines start alike
            model_parallel_cuda_manual_seed(cfg.train.seed)
            task = PretrainTask(cfg, acc, layout)
            task.setup_data()
            engine = MegatronEngine(task, cfg, acc, layout)
            if grad_dtypes is not None:
                grad_dtypes.update(buf.grad_dtype for chunk in engine.model_chunks for buf in chunk.buffers)
            if load is not None:
                engine.load(load)
            losses = [engine.train_step(step).loss for step in range(steps)]
            if save is not None:
                save.mkdir(parents=True)
                engine.save(save)
            adams = engine._torch_adams()
            flags = {(g["fused"], g["foreach"]) for opt in adams for g in opt.param_groups}
            steps_ = [st["step"] for opt in adams for st in opt.state.values()]
        finally:
            shutdown_distributed()
    return losses, flags, steps_


def test_fused_adam_is_used_and_trains_like_foreach(tmp_path: Path) -> None:
    fused, flags, steps = _run(CPUAccelerator(), "fused", 4, save=tmp_path / "fused")
    assert flags == {(True, False)}
    assert steps and all(s.dtype == torch.float32 and s.device.type == "cpu" and float(s) == 4 for s in steps)
    foreach, flags, _ = _run(CPUAccelerator(), "foreach", 4)
    assert flags == {(None, None)}  # megatron-core's construction: torch's defaults
    assert fused == pytest.approx(foreach, rel=1e-5) and fused[-1] < fused[0]
    # a fused run's checkpoint resumes under foreach and the other way round: the same next losses
    after_fused, _, _ = _run(CPUAccelerator(), "foreach", 2, save=tmp_path / "foreach", load=tmp_path / "fused")
    after_foreach, flags, steps = _run(CPUAccelerator(), "fused", 2, load=tmp_path / "fused")
    assert flags == {(True, False)} and all(float(s) == 6 for s in steps)
    assert after_foreach == pytest.approx(after_fused, rel=1e-5)


def test_auto_follows_the_accelerator() -> None:
    assert CPUAccelerator().adam_implementation() == "foreach"
    _, flags, _ = _run(PrefersFused(), "auto", 1)
    assert flags == {(True, False)}
    _, flags, _ = _run(PrefersFused(), "foreach", 1)
    assert flags == {(None, None)}


def test_grad_reduce_in_bf16_halves_the_grad_buffer_and_trains_alike() -> None:
    bf16 = ("train.precision=bf16",)
    dtypes: set = set()
    reduced, _, _ = _run(CPUAccelerator(), "foreach", 4, extra=(*bf16, "train.grad_reduce_in_bf16=true"),
                         grad_dtypes=dtypes)
    assert dtypes == {torch.bfloat16}
    dtypes.clear()
    fp32, _, _ = _run(CPUAccelerator(), "foreach", 4, extra=bf16, grad_dtypes=dtypes)
    assert dtypes == {torch.float32}
    # the first loss precedes any update; then two micro-batches' gradients summed in bf16 instead of fp32
    assert reduced[0] == fp32[0] and reduced != fp32
    assert reduced == pytest.approx(fp32, rel=2e-2) and reduced[-1] < reduced[0]
    with pytest.raises(LoongError, match="grad_reduce_in_bf16=true needs bf16 training"):
        _run(CPUAccelerator(), "foreach", 1, extra=("train.precision=fp32", "train.grad_reduce_in_bf16=true"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_auto_is_fused_and_resumes_across_implementations(tmp_path: Path) -> None:
    """On CUDA ``auto`` is torch's fused AdamW with fp32 steps on the GPU; it trains like foreach (bf16, so not
    bitwise) and resumes from a foreach checkpoint with the steps moved onto the GPU."""
    from loong.core.accelerators.cuda import CUDAAccelerator

    fused, flags, steps = _run(CUDAAccelerator(), "auto", 3)
    assert flags == {(True, False)}
    assert steps and all(s.is_cuda and s.dtype == torch.float32 and float(s) == 3 for s in steps)
    foreach, flags, steps = _run(CUDAAccelerator(), "foreach", 3, save=tmp_path / "foreach")
    assert flags == {(None, None)} and all(not s.is_cuda for s in steps)
    assert fused[0] == foreach[0] and fused == pytest.approx(foreach, rel=1e-2)  # the first loss precedes any update
    resumed, flags, steps = _run(CUDAAccelerator(), "auto", 1, load=tmp_path / "foreach")
    assert flags == {(True, False)} and all(s.is_cuda and float(s) == 4 for s in steps)
    assert resumed[0] < foreach[0]
