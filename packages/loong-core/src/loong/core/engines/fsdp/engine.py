"""The ``fsdp`` engine: builds the task's plain ``nn.Module``, shards it (FSDP2 / HSDP / DDP), steps AdamW."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from loong.core.accelerators.base import Accelerator
from loong.core.config.schema import RunConfig
from loong.core.engines.base import Engine, PendingSave, StepMetrics, num_microbatches, resolve_dtype
from loong.core.engines.fsdp import checkpoint
from loong.core.engines.fsdp.cuda_graph import StepGraphs
from loong.core.engines.fsdp.ema import WeightEMA
from loong.core.engines.fsdp.fp8 import adaptive_refusal, apply_fp8
from loong.core.engines.fsdp.mesh import FSDPLayout, check_parallel, init_mesh
from loong.core.engines.fsdp.schedule import lr_at, param_groups
from loong.core.engines.fsdp.task import FSDPTask
from loong.core.engines.fsdp.wrap import (
    RECOMPUTE,
    apply_compile,
    apply_recompute,
    clean_name,
    graph_breaks,
    shard,
)
from loong.core.errors import LoongError
from loong.core.precision.plan import check_precision
from loong.core.registry import ENGINES, TASKS

#: Keys that only the megatron engine reads: refused here when set, so a key never silently means nothing.
_MEGATRON_ONLY = {"train.distributed_optimizer": False, "train.optimizer_cpu_offload": False,
                  "parallel.sequence_parallel": False, "parallel.etp": None}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def recompute_mode(cfg: RunConfig) -> str:
    """``model.recompute`` for the fsdp engine (``none`` when the model schema has no such key)."""
    mode = getattr(cfg.model, "recompute", None) or "none"
    if mode not in RECOMPUTE:
        raise LoongError(f"model.recompute: {mode!r} is not one of {list(RECOMPUTE)} on the fsdp engine")
    return mode


@ENGINES.register("fsdp")
class FSDPEngine(Engine):
    """One model, sharded per block over the layout's mesh; AdamW, warm-up + decay, clipping, accumulation."""

    engine_name = "fsdp"

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        for dotted, default in _MEGATRON_ONLY.items():
            section, key = dotted.split(".")
            if getattr(getattr(cfg, section), key) != default:
                raise LoongError(f"{dotted}: a megatron engine option; the fsdp engine shards optimiser state with "
                                 "parallel.fsdp=full|hybrid and offloads with parallel.fsdp_cpu_offload=true")
        if cfg.precision.fp8 == "adaptive":
            raise LoongError(adaptive_refusal())
        if cfg.precision.fp8_output_layer:
            raise LoongError("precision.fp8_output_layer=true: a megatron engine option (the output layer inside the "
                             "language-model loss of loong-llm and loong-vlm); on the fsdp engine every eligible "
                             "nn.Linear follows precision.fp8 already, so set precision.fp8_output_layer=false")
        check_parallel(cfg.parallel)
        recompute_mode(cfg)
        if cfg.train.cuda_graphs:
            if cfg.parallel.fsdp != "none":
                raise LoongError(f"train.cuda_graphs=true with parallel.fsdp={cfg.parallel.fsdp}: FSDP2 gathers and "
                                 "frees the parameters around every block, which a replayed graph cannot follow; set "
                                 "parallel.fsdp=none (replicated weights, as DDP) or drop train.cuda_graphs")
            if recompute_mode(cfg) != "none":
                raise LoongError(f"train.cuda_graphs=true with model.recompute={recompute_mode(cfg)}: recomputation "
                                 "is not captured; set model.recompute=none or drop train.cuda_graphs")
            why = TASKS.get(cfg.task).cuda_graph_unsupported(cfg)
            if why is not None:
                raise LoongError(f"train.cuda_graphs=true: {why}; drop train.cuda_graphs")

    @classmethod
    def init_layout(cls, accelerator: Accelerator, cfg: RunConfig) -> FSDPLayout:
        if cfg.train.cuda_graphs and accelerator.graph_backend() is None:  # before anything is written
            raise LoongError(f"train.cuda_graphs=true: the {accelerator.name} accelerator has no graph capture "
                             "(CUDA graphs need an NVIDIA GPU); drop train.cuda_graphs")
        # the megatron engine's FP8 checks (capability, bf16), here so that they fail before anything is written
        check_precision(cfg.precision, accelerator, resolve_dtype(cfg.train.precision, accelerator))
        return init_mesh(accelerator, cfg.parallel)

    def __init__(self, task: FSDPTask, cfg: RunConfig, accelerator: Accelerator, layout: FSDPLayout,
                 fresh: bool = True, echo: Callable[[str], None] | None = None) -> None:
        self.task, self.cfg, self.accelerator, self.layout = task, cfg, accelerator, layout
        self.echo = echo or (print if layout.is_logging_rank else (lambda _m: None))
        t = cfg.train
        self.dtype = resolve_dtype(t.precision, accelerator)
        if t.grad_reduce_in_bf16 and self.dtype != torch.bfloat16:
            raise LoongError(f"train.grad_reduce_in_bf16=true needs bf16 training, but this run trains in {self.dtype} "
                             "(train.precision); set train.precision=bf16 or drop the option")
        self.num_microbatches = num_microbatches(cfg, layout.dp)
        self.device = accelerator.device(layout.local_rank)
        model = task.build_model()
        if fresh:
            task.init_weights(model)  # before sharding: whole tensors, the task's own code
        if not cfg.parallel.fsdp_cpu_offload:
            model = model.to(self.device)
        # FP8 linears by class swap, before the wrappers: they and the checkpoints see the same modules and keys
        self.fp8_plan = apply_fp8(model, cfg.precision, self.device, task.fp8_exclude(), self.echo)
        blocks = apply_recompute(model, task.blocks(model), recompute_mode(cfg), task.mlp)
        if t.compile:
            why = accelerator.fsdp_adaptations().get("compile_unsupported")
            if why:
                raise LoongError(f"train.compile=true: {why}")
            apply_compile(blocks, task.compile_options())
        self.ddp = cfg.parallel.fsdp == "none"
        adaptations = accelerator.fsdp_adaptations()
        backend = accelerator.graph_backend() if t.cuda_graphs else None  # init_layout checked there is one
        self.graphs: StepGraphs | None = None
        if backend is not None:  # replicated weights without DDP: the gradients are all-reduced after the step
            self._broadcast_from_first(model)
            self.model = model
        else:
            self.model = shard(model, blocks, layout, self.dtype, t.grad_reduce_in_bf16,
                               pin_memory="no_pinned_memory" not in adaptations,
                               cast_root_inputs=task.cast_root_inputs)
        self.bare = model  # the unwrapped module (the same object as self.model under FSDP2)
        self.model_chunks = [self.model]
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise LoongError("the model has no trainable parameters (every parameter has requires_grad=False)")
        impl = t.optimizer_impl if t.optimizer_impl != "auto" else accelerator.adam_implementation()
        if impl == "fused" and "no_fused_adam" in accelerator.fsdp_adaptations():
            impl = "foreach"
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, t.weight_decay), lr=lr_at(0, t), betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps, fused=impl == "fused", foreach=impl == "foreach")
        # the moving averages start at the weights the run starts from; a resume loads or restarts them (load)
        self.ema = WeightEMA(((clean_name(n), p) for n, p in self.model.named_parameters() if p.requires_grad),
                             t.ema_decay) if t.ema_decay else None
        if backend is not None:
            self.graphs = StepGraphs(self._forward_backward, self.params, backend, self.echo)
        self.num_steps = 0
        self._cpu_group = dist.new_group(backend="gloo") if t.async_save else None
        self._compile_reported = not t.compile
        self.probe = None
        if t.nonfinite_probe:
            from loong.core.debug import GradientProbe

            self.probe = GradientProbe([self.bare])

    def _broadcast_from_first(self, model: nn.Module) -> None:
        """Every data-parallel rank starts from the first one's weights and buffers (what DDP does when built)."""
        group = self.layout.dp_cp_group
        if dist.get_world_size(group) == 1:
            return
        first = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=first, group=group)

    # --- stepping ----------------------------------------------------------------------------
    def _sync(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Gradient reduction only on the step's last micro-batch (``no_sync`` / FSDP2's gradient-sync switch)."""
        if self.ddp:
            return contextlib.nullcontext() if last else self.model.no_sync()
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        """DDP has no parameter casting of its own: bf16 compute through autocast (FSDP2 casts per block). Under
        ``train.cuda_graphs`` without autocast's cast cache, whose copies would outlive the captured step."""
        if self.ddp and self.dtype != torch.float32:
            return torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=self.graphs is None)
        return contextlib.nullcontext()

    def _forward_backward(self, batch: Any, scale: torch.Tensor) -> torch.Tensor:
        """A prepared micro-batch's forward and backward (gradients scaled by ``scale``); its detached loss: the
        step ``train.cuda_graphs`` captures."""
        with self._autocast():
            loss, _metrics = self.task.loss(self.model, batch)
        (loss * scale).backward()
        return loss.detach()

    def _zero_grads(self) -> None:
        if self.graphs is not None:
            self.graphs.zero_grads()  # the graphs write into this memory: cleared, never freed
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _mean_over_dp_cp(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The micro-batch losses' mean, averaged over data × context parallelism (on the device: no host sync)."""
        if not losses:
            return torch.tensor(math.nan, device=self.device)
        total = torch.stack([x.float().reshape(()) for x in losses]).mean().to(self.device)
        dist.all_reduce(total, group=self.layout.dp_cp_group)
        return total / dist.get_world_size(self.layout.dp_cp_group)

    def _run(self, batches: Any, nmb: int, backward: bool) -> list[torch.Tensor]:
        """Forward (and backward) of ``nmb`` micro-batches; their detached losses."""
        losses = []
        for i, batch in enumerate(batches):
            if i == nmb:
                break
            batch = _to_device(self.task.prepare(self.bare, batch), self.device)
            if backward and self.graphs is not None:
                losses.append(self.graphs.run(batch, 1.0 / nmb, first=i == 0))
                continue
            with self._sync(i == nmb - 1) if backward else contextlib.nullcontext(), self._autocast():
                loss, _metrics = self.task.loss(self.model, batch)
            if backward:
                (loss / nmb).backward()
            losses.append(loss.detach())
        if len(losses) != nmb:
            raise LoongError(f"the task gave {len(losses)} micro-batches for a step of {nmb}")
        if backward and self.graphs is not None:
            self.graphs.reduce_gradients(self.layout.dp_cp_group, self.cfg.train.grad_reduce_in_bf16)
        return losses

    def _grad_norm(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole model's gradient norm (reduced across shards; NaN/Inf exactly when some gradient is), as the
        clipping takes it (a DTensor under FSDP2) and as a plain tensor."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            zero = torch.zeros((), device=self.device)
            return zero, zero
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        return norm, norm.full_tensor() if isinstance(norm, DTensor) else norm

    def _nonfinite_params(self) -> list[str]:
        local = sorted({clean_name(n) for n, p in self.model.named_parameters()
                        if p.grad is not None and not torch.isfinite(_local(p.grad)).all()})
        gathered: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        return sorted({n for names in gathered for n in names or []})

    def _report_compile(self) -> None:
        """Say once, after the first compiled step, where torch.compile broke its graphs (or that it did not)."""
        self._compile_reported = True
        breaks = graph_breaks()
        if not breaks:
            self.echo("train.compile: every block compiled without graph breaks")
            return
        listed = "; ".join(f"{reason} (x{n})" for reason, n in sorted(breaks.items(), key=lambda kv: -kv[1])[:5])
        self.echo(f"train.compile: {sum(breaks.values())} graph break(s): {listed}")

    def train_step(self, step: int) -> StepMetrics:
        t = self.cfg.train
        self.model.train()
        self._zero_grads()
        nmb = self.task.num_train_microbatches(step, self.num_microbatches)
        started = time.perf_counter()
        if self.probe is not None:
            self.probe.reset()
        losses = self._run(self.task.train_microbatches(step, nmb), nmb, backward=True)
        extra: dict[str, float] = {}
        if self.task.measures_compute_time():  # this rank's own compute, before anything waits for the others
            self.accelerator.synchronize()
            extra["compute_s"] = time.perf_counter() - started
        loss_t = self._mean_over_dp_cp(losses)
        norm_clip, norm_t = self._grad_norm()
        # the step's one host sync: loss and gradient norm together (a NaN/Inf gradient makes the norm NaN/Inf)
        loss, norm = torch.stack([loss_t.float(), norm_t.float().to(self.device)]).tolist()
        if not self._compile_reported:
            self._report_compile()
        lr = lr_at(self.num_steps, t)
        loss_bad, grads_bad = not math.isfinite(loss), not math.isfinite(norm)
        if loss_bad or grads_bad:
            names = self._nonfinite_params() if grads_bad else []
            origin = None
            if grads_bad and self.probe is not None:
                gathered: list[str | None] = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, self.probe.report())
                origin = next((f"{r} (rank {i})" for i, r in enumerate(gathered) if r), None)
            self._zero_grads()
            extra.update(loss_finite=float(not loss_bad), grads_nonfinite=float(grads_bad))
            return StepMetrics(loss=loss, lr=lr, skipped=True, nonfinite=True, extra=extra,
                               nonfinite_params=names, nonfinite_origin=origin)
        if t.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, t.clip_grad, norm_clip, foreach=True)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.ema is not None:
            self.ema.update()
        self.num_steps += 1
        return StepMetrics(loss=loss, grad_norm=norm, lr=lr, extra=extra)

    @torch.no_grad()
    def eval_loss(self, iters: int) -> float | None:
        if iters <= 0:
            return None
        self.model.eval()
        losses = []
        for i in range(iters):
            nmb = self.task.num_eval_microbatches(i, self.num_microbatches)
            losses.append(float(self._mean_over_dp_cp(self._run(self.task.eval_microbatches(i, nmb), nmb,
                                                                backward=False))))
        self.model.train()
        return sum(losses) / len(losses)

    # --- state -------------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        checkpoint.save(self.model, self.optimizer, directory, self.ema)

    def save_async(self, directory: Path, finalize: Callable[[], None]) -> PendingSave:
        return checkpoint.save_async(self.model, self.optimizer, directory, finalize, self._cpu_group, self.device,
                                     self.ema)

    def check_resume_layout(self, saved: dict) -> None:
        """Nothing to refuse: DCP reshards model and optimiser state across every fsdp layout."""

    def load(self, directory: Path, load_optimizer: bool = True, allow_missing: bool = False) -> None:
        loaded_ema = checkpoint.load(self.model, self.optimizer, directory, load_optimizer, allow_missing, self.ema)
        if self.ema is not None and not loaded_ema:
            self.ema.reset()
            if load_optimizer:  # a weights-only checkpoint never has one: nothing to say there
                self.echo(f"train.ema_decay: {directory.name} holds no moving averages of the weights; they start "
                          "at its weights")

    def scheduler_state(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_scheduler_state(self, state: dict) -> None:
        self.num_steps = int(state.get("num_steps", 0))

    def memory_hints(self, task_hints: list[str]) -> list[str]:
        t, p = self.cfg.train, self.cfg.parallel
        hints = list(task_hints)
        if recompute_mode(self.cfg) == "none":
            hints.append("model.recompute=selective (each block's MLP recomputed in the backward), or full")
        elif recompute_mode(self.cfg) == "selective":
            hints.append("model.recompute=full (each block's whole forward recomputed in the backward)")
        if t.micro_batch_size > 1:
            hints.append(f"train.micro_batch_size={t.micro_batch_size // 2} (the global batch stays; more accumulation)")
        if p.fsdp == "none" and self.layout.dp > 1:
            hints.append("parallel.fsdp=full (parameters, gradients and Adam's state sharded over data parallelism)")
        if p.fsdp == "hybrid":
            hints.append("parallel.fsdp=full (shard over every rank, not within replica groups)")
        if self.dtype == torch.bfloat16 and not t.grad_reduce_in_bf16:
            hints.append("train.grad_reduce_in_bf16=true (gradients reduced in bf16)")
        if p.fsdp != "none" and not p.fsdp_cpu_offload:
            hints.append("parallel.fsdp_cpu_offload=true (parameters, gradients and Adam's state in host memory)")
        hints.append("longer sequences over more devices: parallel.cp_ulysses / parallel.cp_ring")
        return hints

    def export_model(self) -> nn.Module:
        """The trained model; with ``train.export_ema`` its weights are first replaced by their moving averages
        (the export is the run's last act, after the final checkpoint, which keeps both)."""
        if self.cfg.train.export_ema and self.ema is not None:
            self.ema.copy_to_params()
        return self.model
