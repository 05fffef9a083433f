"""``train.optimizer_impl``: torch AdamW's fused kernel against its foreach path inside megatron-core's optimiser.

On the CPU (where torch also has a fused AdamW) the engine is built both ways on the tiny preset: the fused one must
really be fused (every group's flags; each ``step`` an fp32 tensor on the parameter's device), train to the same
losses, and take a checkpoint written by the other implementation. ``auto`` follows the accelerator (the CUDA
plugin picks fused). Bit-exact resume with the fused kernel is in test_fault_tolerance (layout ``tp1-fused``).
``train.optimizer_cpu_offload``: refused with its reason where it cannot run (CPU) or is misconfigured; on CUDA it
trains like the on-device optimizer with its state in host memory, and resumes from its own checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from loong.core.accelerators.cpu import CPUAccelerator
from loong.core.config import compose_config
from loong.core.engines.megatron.engine import MegatronEngine
from loong.core.engines.megatron.layout import init_distributed, shutdown_distributed
from loong.core.errors import LoongError
from loong.llm.pretrain import PretrainTask
from loong.llm.schema import LLMRunConfig

SETTINGS = ["train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2", "train.lr=1e-2",
            "train.warmup_steps=0", "model.fused_kernels=off"]


class PrefersFused(CPUAccelerator):
    """A CPU accelerator that asks for the fused AdamW, as the CUDA plugin does."""

    def adam_implementation(self) -> str:
        return "fused"


def _run(acc: CPUAccelerator, impl: str, steps: int, save: Path | None = None, load: Path | None = None,
         extra: tuple[str, ...] = (), grad_dtypes: set | None = None, inspect=None,  # noqa: ANN001
         first_step: int = 0):
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
            if first_step:  # resuming as the trainer does: the schedule's place, the data of the steps that follow
                engine.load_scheduler_state({"num_steps": first_step})
            losses = [engine.train_step(step).loss for step in range(first_step, first_step + steps)]
            if inspect is not None:
                inspect(engine)
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


class CanOffload(CPUAccelerator):
    """A CPU accelerator claiming the offload capability, to reach the checks after it."""

    def capabilities(self) -> set[str]:
        return {"optimizer_offload"}


def test_optimizer_offload_is_refused_with_its_reason() -> None:
    offload = "train.optimizer_cpu_offload=true"
    with pytest.raises(LoongError, match=r"optimizer_cpu_offload=true: the cpu accelerator cannot offload"):
        _run(CPUAccelerator(), "auto", 1, extra=(offload, "train.distributed_optimizer=true"))
    with pytest.raises(LoongError, match=r"needs train\.distributed_optimizer=true"):
        _run(CanOffload(), "auto", 1, extra=(offload,))
    with pytest.raises(LoongError, match=r"optimizer_offload_fraction=0\.0: .* in \(0, 1\]"):
        _run(CanOffload(), "auto", 1, extra=(offload, "train.distributed_optimizer=true",
                                             "train.optimizer_offload_fraction=0"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_optimizer_offload_trains_alike_and_resumes(tmp_path: Path) -> None:
    """Offloaded, megatron-core's HybridDeviceOptimizer holds the fp32 master weights and Adam's moments in host
    memory; the losses follow the on-device optimizer's (bf16 forward, fp32 AdamW either side), and a checkpoint
    taken offloaded resumes offloaded with the same next losses as the run that went on."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from loong.core.accelerators.cuda import CUDAAccelerator

    dist_opt = ("train.precision=bf16", "train.distributed_optimizer=true")
    offload = (*dist_opt, "train.optimizer_cpu_offload=true")
    seen: dict = {}

    def state_devices(engine) -> None:  # noqa: ANN001
        inner = engine.optimizer.optimizer
        seen["hybrid"] = isinstance(inner, HybridDeviceOptimizer)
        seen["devices"] = {v.device.type for st in inner.state.values() for v in st.values()
                           if isinstance(v, torch.Tensor) and v.numel() > 1}

    on_device, _, _ = _run(CUDAAccelerator(), "auto", 5, extra=dist_opt)
    offloaded, _, _ = _run(CUDAAccelerator(), "auto", 5, extra=offload, inspect=state_devices)
    assert seen == {"hybrid": True, "devices": {"cpu"}}
    assert offloaded[0] == on_device[0] and offloaded[-1] < offloaded[0]
    assert offloaded == pytest.approx(on_device, rel=2e-2)
    first, _, _ = _run(CUDAAccelerator(), "auto", 3, extra=offload, save=tmp_path / "offloaded")
    resumed, _, _ = _run(CUDAAccelerator(), "auto", 2, extra=offload, load=tmp_path / "offloaded", first_step=3)
    assert first == pytest.approx(offloaded[:3], rel=1e-5)
    assert resumed == pytest.approx(offloaded[3:], rel=1e-3)
