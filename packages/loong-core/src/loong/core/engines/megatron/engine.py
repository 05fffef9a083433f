"""The ``megatron`` engine: megatron-core models, DDP, (distributed) optimiser and pipeline schedules."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from loong.core.accelerators.base import Accelerator
from loong.core.accelerators.capabilities import OPTIMIZER_OFFLOAD
from loong.core.config.schema import RunConfig, TrainConfig
from loong.core.engines.base import Engine, PendingSave, StepMetrics, num_microbatches, resolve_dtype
from loong.core.engines.megatron.fp8 import apply_fp8, check_precision
from loong.core.engines.megatron.layout import (
    MegatronLayout,
    init_distributed,
    nearest_multiples,
    shutdown_distributed,
)
from loong.core.engines.megatron.optimizer_state import (
    load_merged_state_dict,
    match_saved_keys,
    merged_sharded_state_dict,
)
from loong.core.engines.megatron.state import unwrap
from loong.core.engines.megatron.task import MegatronTask
from loong.core.engines.megatron.wgrad_fusion import apply_wgrad_fusion
from loong.core.errors import LoongError
from loong.core.registry import ENGINES, TASKS
from loong.core.trainer.out_of_memory import memory_options

#: Common (non-sharded) entry of every checkpoint: the layout it was written at (EP/ETP are not in
#: ``trainer_state.json``'s layout).
LAYOUT_KEY = "loong_layout"


def check_optimizer_offload(train: TrainConfig, accelerator: Accelerator) -> None:
    """Refuse ``train.optimizer_cpu_offload`` where it cannot run, before any model is built."""
    if not train.optimizer_cpu_offload:
        return
    if OPTIMIZER_OFFLOAD not in accelerator.capabilities():
        raise LoongError(f"train.optimizer_cpu_offload=true: the {accelerator.name} accelerator cannot offload the "
                         "optimizer (megatron-core's HybridDeviceOptimizer needs CUDA streams and pinned host memory); "
                         "set train.optimizer_cpu_offload=false")
    if not train.distributed_optimizer:
        raise LoongError("train.optimizer_cpu_offload=true needs train.distributed_optimizer=true (as Megatron-LM's "
                         "--optimizer-cpu-offload: the offloaded state is the distributed optimizer's shards)")
    if not 0.0 < train.optimizer_offload_fraction <= 1.0:
        raise LoongError(f"train.optimizer_offload_fraction={train.optimizer_offload_fraction}: give the share of "
                         "the optimizer state kept in host memory, in (0, 1]")


def check_interleaved_microbatches(cfg: RunConfig, dp: int) -> None:
    """The interleaved pipeline (``parallel.vpp``) runs each step's micro-batches in groups of ``parallel.pp``
    (megatron-core's ``microbatch_group_size_per_vp_stage``, which Loong leaves at pp): their number must be a
    multiple of pp, or megatron-core stops in the first step (a ``RuntimeError`` on the last group's "dependency
    bubbles", or a ``ValueError`` below pp). Refused before any model is built, naming the batch keys."""
    p, t = cfg.parallel, cfg.train
    count = num_microbatches(cfg, dp)
    if not p.vpp or not count % p.pp:
        return
    step = t.micro_batch_size * dp * p.pp
    raise LoongError(f"the interleaved pipeline (parallel.vpp={p.vpp}) runs micro-batches in groups of parallel.pp="
                     f"{p.pp}; train.global_batch_size={t.global_batch_size} / (train.micro_batch_size="
                     f"{t.micro_batch_size} x data-parallel size {dp}) = {count} micro-batches per step is not a "
                     f"multiple of {p.pp}; allowed: train.global_batch_size a multiple of {step}, e.g. "
                     f"{nearest_multiples(t.global_batch_size, step)}")


@ENGINES.register("megatron")
class MegatronEngine(Engine):
    """Builds the task's model chunks (one per virtual pipeline stage) and steps them."""

    engine_name = "megatron"

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        p = cfg.parallel
        fsdp_only = {"parallel.fsdp": (p.fsdp, "full"), "parallel.dp_replicate": (p.dp_replicate, -1),
                     "parallel.dp_shard": (p.dp_shard, -1), "parallel.cp_ulysses": (p.cp_ulysses, 1),
                     "parallel.cp_ring": (p.cp_ring, 1), "parallel.fsdp_cpu_offload": (p.fsdp_cpu_offload, False),
                     "train.compile": (cfg.train.compile, False),
                     "train.cuda_graphs": (cfg.train.cuda_graphs, False)}
        for key, (value, default) in fsdp_only.items():
            if value != default:
                raise LoongError(f"{key}={value}: an fsdp engine option; the megatron engine's data parallelism is "
                                 "megatron DDP (train.distributed_optimizer=true shards the optimiser) and its context "
                                 "parallelism parallel.cp; drop the key or use engine=fsdp")
        for key, value, default in (("train.ema_decay", cfg.train.ema_decay, 0.0),
                                    ("train.export_ema", cfg.train.export_ema, False)):
            if value != default:
                raise LoongError(f"{key}={value}: the EMA of the weights is an fsdp engine option (the megatron "
                                 "engine keeps none); drop the key or use engine=fsdp")

    @classmethod
    def init_layout(cls, accelerator: Accelerator, cfg: RunConfig) -> MegatronLayout:
        task_cls = TASKS.get(cfg.task)  # its components' own tensor-parallel groups are built with the layout
        components = task_cls.component_layouts(cfg) if issubclass(task_cls, MegatronTask) else {}
        return init_distributed(accelerator, cfg.parallel, components)

    @classmethod
    def seed(cls, seed: int, accelerator: Accelerator, layout: MegatronLayout) -> None:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        accelerator.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)  # the tensor-parallel RNG tracker's streams (dropout in TP regions)

    @classmethod
    def shutdown(cls, layout: MegatronLayout | None, clean: bool = False) -> None:
        shutdown_distributed(destroy_default=layout is None or layout.owns_group, barrier=clean)

    def __init__(self, task: MegatronTask, cfg: RunConfig, accelerator: Accelerator, layout: MegatronLayout,
                 fresh: bool = True) -> None:
        self.task, self.cfg, self.accelerator, self.layout = task, cfg, accelerator, layout
        self.dtype = resolve_dtype(cfg.train.precision, accelerator)
        check_precision(cfg.precision, accelerator, self.dtype)  # FP8 fails here, before any model is built
        check_optimizer_offload(cfg.train, accelerator)
        self.num_microbatches = num_microbatches(cfg, layout.dp)
        check_interleaved_microbatches(cfg, layout.dp)
        self.config = task.model_config(self.dtype)
        # megatron-core keeps the MoE aux loss's backward scale in class state, shaped by the first schedule that sets
        # it ([] or [1], depending on calculate_per_token_loss) and copied into afterwards: each engine starts without
        # one, so a second run in the process (a test, a tool) with the other loss-scale shape does not fail
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        if cfg.parallel.pp > 1 and cfg.parallel.vpp:
            # Unbatched p2p for the interleaved schedule, as Megatron-LM's default (it batches only
            # without p2p overlap). Batched p2p mis-pairs messages when both pipeline neighbours are
            # the same rank (PP=2): seen on gloo, and on two H200s as a PP=2×VPP=2 run that did not learn.
            self.config.batch_p2p_comm = False
        device = accelerator.device(layout.local_rank)
        vpp = cfg.parallel.vpp or 1
        chunks = []
        for vp in range(vpp):
            stage = vp if vpp > 1 else None
            pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
            post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
            chunks.append(task.build_model(self.config, pre, post, stage).to(device))
        if fresh:
            task.init_weights(chunks)  # before DDP/optimiser so fp32 main params see the weights
        apply_fp8(chunks, cfg, accelerator, layout.local_rank, print if layout.is_logging_rank else None)
        apply_wgrad_fusion(chunks)  # the other linears: dW straight into DDP's main_grad (wgrad_fusion.py)
        if self.dtype != torch.float32:
            chunks = [Float16Module(self.config, c) for c in chunks]
        t = cfg.train
        if t.grad_reduce_in_bf16 and self.dtype != torch.bfloat16:
            raise LoongError(f"train.grad_reduce_in_bf16=true needs bf16 training, but this run trains in {self.dtype} "
                             "(train.precision); set train.precision=bf16 or drop the option")
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=not t.grad_reduce_in_bf16,
            overlap_grad_reduce=False,
            use_distributed_optimizer=t.distributed_optimizer,
            check_for_nan_in_grad=False,
        )
        self.model_chunks = [
            DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=c,
                                    disable_bucketing=i > 0, pg_collection=layout.pg_collection)
            for i, c in enumerate(chunks)
        ]
        optimizer_config = OptimizerConfig(
            optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
            clip_grad=t.clip_grad, bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
            use_distributed_optimizer=t.distributed_optimizer,
            # Megatron-LM pairs --optimizer-cpu-offload with --use-precision-aware-optimizer: the offloading
            # optimizer then keeps the fp32 master weights itself (on the host) instead of the distributed one
            optimizer_cpu_offload=t.optimizer_cpu_offload, use_precision_aware_optimizer=t.optimizer_cpu_offload,
            optimizer_offload_fraction=t.optimizer_offload_fraction if t.optimizer_cpu_offload else 0.0,
        )
        # megatron's standard groups (what passing None gives) plus the task's own (e.g. per-component LRs)
        overrides = {**get_standard_config_overrides(optimizer_config), **task.optimizer_overrides(t.lr, t.min_lr)}
        self.optimizer = get_megatron_optimizer(optimizer_config, self.model_chunks, config_overrides=overrides)
        impl = t.optimizer_impl if t.optimizer_impl != "auto" else self.accelerator.adam_implementation()
        # offloaded, megatron-core builds its own AdamWs (fused on the CPU part): nothing of ours to switch
        self.adam_fused = impl == "fused" and not t.optimizer_cpu_offload
        self._apply_adam_implementation()
        warmup = min(t.warmup_steps, max(t.steps - 1, 0))
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if warmup else t.lr, max_lr=t.lr, min_lr=t.min_lr,
            lr_warmup_steps=warmup, lr_decay_steps=max(t.steps, 1), lr_decay_style=t.lr_decay_style,
            start_wd=t.weight_decay, end_wd=t.weight_decay, wd_incr_steps=max(t.steps, 1),
            wd_incr_style="constant",
        )
        c = self.config
        c.no_sync_func = [m.no_sync for m in self.model_chunks]
        if len(self.model_chunks) == 1:
            c.no_sync_func = c.no_sync_func[0]
        c.grad_scale_func = self.optimizer.scale_loss
        c.finalize_model_grads_func = self._finalize_grads
        self._measure = False  # asked of the task every step
        self.probe = None
        if t.nonfinite_probe:
            from loong.core.debug import GradientProbe

            self.probe = GradientProbe([unwrap(c) for c in self.model_chunks])
        self._compute_end = 0.0
        self._forward_backward = get_forward_backward_func()

    # --- stepping --------------------------------------------------------------------------
    def _finalize_grads(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        """megatron's gradient all-reduce, timestamped first: the time before it is this rank's own
        compute (data balancing fits its cost model to it); the reduce waits for the slowest rank."""
        if self._measure:
            self.accelerator.synchronize()
            self._compute_end = time.perf_counter()
        kwargs.setdefault("pg_collection", self.layout.pg_collection)
        return finalize_model_grads(*args, **kwargs)

    def _iterators(self, make):  # noqa: ANN001, ANN202
        its = [make() for _ in self.model_chunks]
        return its if len(its) > 1 else its[0]

    def _run(self, data_iterator, forward_only: bool, num_microbatches: int | None = None) -> float:  # noqa: ANN001
        t = self.cfg.train
        outputs = self._forward_backward(
            forward_step_func=self.task.forward_step,
            data_iterator=data_iterator,
            model=self.model_chunks,
            num_microbatches=num_microbatches or self.num_microbatches,
            seq_length=t.seq_length,
            micro_batch_size=t.micro_batch_size,
            decoder_seq_length=t.seq_length,
            forward_only=forward_only,
        )
        return self._mean_loss(outputs)

    def _mean_loss(self, outputs: list[dict]) -> float:
        """Mean of the micro-batch losses on the last stage, averaged over data parallelism."""
        if not outputs:
            return math.nan
        device = self.accelerator.device(self.layout.local_rank)
        total = torch.stack([o["loss"].detach().float().reshape(()) for o in outputs]).mean().to(device)
        dist.all_reduce(total, group=self.layout.pg_collection.dp_cp)
        return float(total) / dist.get_world_size(self.layout.pg_collection.dp_cp)

    def _nonfinite(self, loss: float) -> tuple[bool, bool]:
        """(loss, gradients) NaN/Inf anywhere: the same answer on every rank.

        Checked before the optimiser step: megatron-core only checks for fp16 loss scaling, and a
        NaN gradient would otherwise be clipped into NaN weights.
        """
        device = self.accelerator.device(self.layout.local_rank)
        flags = torch.zeros(2, device=device)
        flags[0] = float(self.layout.is_last_stage and not math.isfinite(loss))
        for chunk in self.model_chunks:
            for buffer in [*getattr(chunk, "buffers", []), *getattr(chunk, "expert_parallel_buffers", [])]:
                # on the device, no host sync per buffer: one for the whole check, at the all-reduce
                flags[1] = torch.maximum(flags[1], (~torch.isfinite(buffer.grad_data)).any().float())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0] > 0), bool(flags[1] > 0)

    def _nonfinite_params(self) -> list[str]:
        """Names of the parameters whose gradient holds NaN/Inf, over every rank (sorted; only called once a
        step is already known to be bad, so the per-parameter host syncs do not cost a healthy step)."""
        local = sorted({name for chunk in self.model_chunks for name, p in unwrap(chunk).named_parameters()
                        if getattr(p, "main_grad", None) is not None and not torch.isfinite(p.main_grad).all()})
        gathered: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        return sorted({name for names in gathered for name in names or []})

    def _nonfinite_origin(self) -> str:
        """The gradient probe's finding, from the lowest rank that has one (a collective)."""
        gathered: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.probe.report())
        found = [(rank, r) for rank, r in enumerate(gathered) if r]
        if not found:
            return "the gradient probe saw only finite activation gradients: it arose in a parameter's own gradient"
        return f"{found[0][1]} (rank {found[0][0]})"

    def train_step(self, step: int) -> StepMetrics:
        for m in self.model_chunks:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        nmb = self.task.num_train_microbatches(step, self.num_microbatches)
        self._measure = self.task.measures_compute_time()
        started = time.perf_counter()
        if self.probe is not None:
            self.probe.reset()
        loss = self._run(self._iterators(lambda: self.task.train_microbatches(step, nmb)),
                         forward_only=False, num_microbatches=nmb)
        extra = {"compute_s": self._compute_end - started} if self._measure else {}
        loss_bad, grads_bad = self._nonfinite(loss)
        if loss_bad or grads_bad:
            names = self._nonfinite_params() if grads_bad else []
            origin = self._nonfinite_origin() if grads_bad and self.probe is not None else None
            for m in self.model_chunks:
                m.zero_grad_buffer()
            extra.update(loss_finite=float(not loss_bad), grads_nonfinite=float(grads_bad))
            return StepMetrics(loss=loss, lr=self._logged_lr(), skipped=True,
                               nonfinite=True, extra=extra, nonfinite_params=names, nonfinite_origin=origin)
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        return StepMetrics(loss=loss, grad_norm=None if grad_norm is None else float(grad_norm),
                           lr=self._logged_lr(), skipped=not ok, extra=extra)

    def _logged_lr(self) -> float:
        """The schedule's learning rate (``train.lr``'s): the first group megatron marks as on the default
        schedule, not one a task scaled (:meth:`MegatronTask.optimizer_overrides`)."""
        from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

        groups = self.optimizer.param_groups
        lr = get_canonical_lr_for_logging(groups)
        return float(groups[0]["lr"] if lr is None else lr)

    @torch.no_grad()
    def eval_loss(self, iters: int) -> float | None:
        if iters <= 0:
            return None
        for m in self.model_chunks:
            m.eval()
        losses = []
        for i in range(iters):
            nmb = self.task.num_eval_microbatches(i, self.num_microbatches)
            losses.append(self._run(self._iterators(lambda i=i, nmb=nmb: self.task.eval_microbatches(i, nmb)),
                                    forward_only=True, num_microbatches=nmb))
        for m in self.model_chunks:
            m.train()
        return sum(losses) / len(losses)

    # --- state -----------------------------------------------------------------------------
    def _model_sd(self) -> dict:
        # Keys are those of the bare model (no DDP / Float16Module prefixes), as in any layout.
        bare = [unwrap(m) for m in self.model_chunks]
        if len(bare) == 1:
            return {"model": bare[0].sharded_state_dict()}
        return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(bare)}

    def _optimizer_sd(self, model_sd: dict, is_loading: bool) -> dict:
        # The plain optimiser: one entry per parameter keyed by the model's sharded keys, whatever
        # megatron's split into a dense and an expert optimiser (EP > 1), so it reshards across any
        # TP/PP/DP/EP change (loong.core.engines.megatron.optimizer_state). The distributed optimiser uses
        # 'dp_reshardable' (DP changes only): in megatron-core 0.19.2 without Apex/TE its
        # layout-free formats fail ('fully_sharded_model_space' builds flattened ShardedTensors its
        # own validation rejects; loading 'fully_reshardable' raises KeyError 'step').
        if not self.cfg.train.distributed_optimizer:
            return merged_sharded_state_dict(self.optimizer, model_sd, is_loading)
        return self.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
        )

    def _layout_record(self) -> dict:
        """The layout facts a resume needs that ``trainer_state.json`` lacks (common, non-sharded)."""
        p = self.layout.config
        return {"ep": p.ep, "etp": p.etp or p.tp, "tp": p.tp, "pp": p.pp,
                "distributed_optimizer": self.cfg.train.distributed_optimizer}

    def _state_to_save(self) -> dict:
        sd = self._model_sd()
        sd["optimizer"] = self._optimizer_sd(sd, is_loading=False)
        sd[LAYOUT_KEY] = self._layout_record()
        return sd

    def check_resume_layout(self, saved: dict) -> None:
        """Fail clearly when the optimiser state saved under ``saved`` cannot load at this layout."""
        dist_opt = self.cfg.train.distributed_optimizer
        if saved.get("distributed_optimizer", dist_opt) != dist_opt:
            raise LoongError(
                f"the checkpoint was saved with train.distributed_optimizer={not dist_opt}; "
                f"resume with the same setting"
            )
        same = (saved.get("tp"), saved.get("pp")) == (self.layout.tp, self.layout.pp)
        if dist_opt and not same:
            raise LoongError(
                f"the checkpoint was saved at tp={saved.get('tp')} pp={saved.get('pp')} with the "
                f"distributed optimiser, whose state reshards only across data parallelism; resume at "
                f"that tp/pp (any dp), or train with train.distributed_optimizer=false to change tp/pp"
            )

    def save(self, directory: Path) -> None:
        dist_checkpointing.save(self._state_to_save(), str(directory))

    def save_async(self, directory: Path, finalize: Callable[[], None]) -> PendingSave:
        """Start writing the shards in the background with megatron-core's own async writer ('mcore'; 'nvrx'
        needs nvidia-resiliency-ext)."""
        request = dist_checkpointing.save(self._state_to_save(), str(directory), async_sharded_save=True,
                                          async_strategy="mcore")
        request.add_finalize_fn(finalize)
        return _MegatronPendingSave(request)

    def memory_hints(self, task_hints: list[str]) -> list[str]:
        return memory_options(self.cfg, self.accelerator, self.layout.dp, self.dtype == torch.bfloat16, task_hints)

    def rng_state(self) -> dict[str, Any]:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        return {"megatron_tracker": get_cuda_rng_tracker().get_states()}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        if "megatron_tracker" in state:
            get_cuda_rng_tracker().set_states(state["megatron_tracker"])

    def layout_record(self) -> dict[str, Any]:
        return {**self.layout.record(), "distributed_optimizer": self.cfg.train.distributed_optimizer}

    def loss_scale(self) -> float:
        """The optimiser's current loss scale (1.0 without fp16 dynamic scaling)."""
        return float(self.optimizer.get_loss_scale())

    def _materialise_optimizer_state(self) -> None:
        """Give a fresh distributed optimiser its (zero) Adam states before loading into it.

        megatron-core 0.19 without Apex/TE reads Adam's ``step`` while building the *loading*
        state dict, which a never-stepped optimiser lacks. Its own dummy-state helper runs one
        Adam step on zero gradients; with the learning rate held at 0 that leaves weights untouched.
        """
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
            if init is None or opt.optimizer.state:
                continue
            lrs = [g["lr"] for g in opt.optimizer.param_groups]
            for g in opt.optimizer.param_groups:
                g["lr"] = 0.0
            init()
            for g, lr in zip(opt.optimizer.param_groups, lrs, strict=True):
                g["lr"] = lr

    def _check_distributed_optimizer_layout(self, directory: Path, saved: set[str]) -> None:
        """The distributed optimiser's 'dp_reshardable' state is laid out per expert-parallel rank:
        refuse an EP/ETP change clearly instead of failing inside megatron-core."""
        record = dist_checkpointing.load_common_state_dict(str(directory)).get(LAYOUT_KEY)
        p = self.layout.config
        now = (p.ep, p.etp or p.tp)
        if record is not None:
            then = (record.get("ep"), record.get("etp"))
        else:  # written before the record: a separate expert optimiser (chained_1.) means EP > 1
            experts_then = any(k.startswith("chained_1.") for k in saved)
            experts_now = len(getattr(self.optimizer, "chained_optimizers", [])) > 1
            if experts_then == experts_now:
                return
            then = ("> 1" if experts_then else 1, "?")
        if then != now:
            raise LoongError(
                f"the checkpoint was saved at ep={then[0]} etp={then[1]} with the distributed optimiser, "
                f"whose state reshards only across data parallelism; resume at that ep/etp (now ep={now[0]} "
                f"etp={now[1]}), or train with train.distributed_optimizer=false to change ep/etp/tp/pp"
            )

    def _torch_adams(self) -> list[torch.optim.Optimizer]:
        """The torch Adam/AdamW instances inside megatron-core's (possibly chained) optimiser, including those of an
        offloading ``HybridDeviceOptimizer`` (its CPU and device parts)."""
        inner = [getattr(o, "optimizer", None) for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]
        inner = [sub for o in inner for sub in getattr(o, "sub_optimizers", [o])]
        return [o for o in inner if isinstance(o, torch.optim.Adam)]

    def _apply_adam_implementation(self) -> None:
        """Switch torch AdamW to its fused kernel when chosen; called after building and after every load.

        megatron-core builds ``torch.optim.AdamW`` with torch's defaults (foreach), and torch's
        ``load_state_dict`` takes the saved groups' flags, so the choice is re-applied after each load. The fused kernel keeps
        each parameter's ``step`` on the parameter's device in fp32 (foreach keeps it on the host); existing
        steps are moved there, with their values unchanged, so a checkpoint from either implementation resumes
        in the other.
        """
        if not self.adam_fused:
            return
        for opt in self._torch_adams():
            opt.defaults.update(fused=True, foreach=False)
            for group in opt.param_groups:
                group.update(fused=True, foreach=False)
                for param in group["params"]:
                    state = opt.state.get(param)
                    if state and isinstance(state.get("step"), torch.Tensor):
                        state["step"] = state["step"].to(device=param.device, dtype=torch.float32)

    def _restore_adam_steps(self) -> None:
        """Give torch Adam's per-parameter ``step`` the loaded step of its group (distributed optimiser).

        megatron-core 0.19.2 loads the step into ``param_groups`` (TE FusedAdam's place) and sets it
        per parameter, but its 'dp_reshardable' parameter state then copies the *current* per-parameter
        step back over it — the 1 of :meth:`_materialise_optimizer_state`'s dummy step — so torch Adam's
        bias correction restarted after every resume. One tensor per parameter: torch's foreach Adam
        increments each listed step tensor.
        """
        for inner in self._torch_adams():
            for group in inner.param_groups:
                if group.get("step") is None:
                    continue
                for param in group["params"]:
                    state = inner.state.get(param)
                    if state and isinstance(state.get("step"), torch.Tensor):
                        old = state["step"]
                        state["step"] = torch.tensor(float(group["step"]), dtype=old.dtype, device=old.device)

    def load(self, directory: Path, load_optimizer: bool = True, allow_missing: bool = False) -> None:
        sd = self._model_sd()
        absent: set[str] = set()
        saved = set(dist_checkpointing.load_tensors_metadata(str(directory)))
        if allow_missing:
            # A weights-only checkpoint (e.g. converted from HF) lacks what this run adds, such as
            # LoRA adapters: load what it has and keep the fresh initialisation of the rest.
            for chunk_sd in sd.values():
                for name in [n for n, v in chunk_sd.items() if getattr(v, "key", None) not in saved]:
                    if hasattr(chunk_sd[name], "key"):
                        absent.add(name)
                        del chunk_sd[name]
        dist_opt = self.cfg.train.distributed_optimizer
        if load_optimizer:
            if dist_opt:
                self._check_distributed_optimizer_layout(directory, saved)
            self._materialise_optimizer_state()
            sd["optimizer"] = self._optimizer_sd(sd, is_loading=True)
            if not dist_opt:
                match_saved_keys(sd["optimizer"], saved)  # older EP > 1 checkpoints: chained_<i>. keys
        loaded = dist_checkpointing.load(sd, str(directory))
        for key, chunk in zip(self._model_sd(), self.model_chunks, strict=True):
            result = unwrap(chunk).load_state_dict(loaded[key], strict=not absent)
            missing = set(getattr(result, "missing_keys", [])) - absent
            missing = {k for k in missing if not k.endswith("_extra_state")}
            if missing:
                raise LoongError(f"{directory} lacks model weights {sorted(missing)[:3]}")
        if load_optimizer:
            # With fp32 params the distributed optimiser's main shards are views of the model's
            # leaf parameters; loading in-place needs autograd off.
            with torch.no_grad():
                if dist_opt:
                    self.optimizer.load_state_dict(loaded["optimizer"])
                    self._restore_adam_steps()
                else:
                    load_merged_state_dict(self.optimizer, loaded["optimizer"])
            self._apply_adam_implementation()

    def scheduler_state(self) -> dict:
        """Scheduler counters (saved in ``trainer_state.json``)."""
        return {"num_steps": self.scheduler.num_steps}

    def load_scheduler_state(self, state: dict) -> None:
        """Restore the LR schedule position."""
        self.scheduler.step(increment=int(state.get("num_steps", 0)) - self.scheduler.num_steps)


class _MegatronPendingSave(PendingSave):
    """megatron-core's ``AsyncRequest`` in its ``AsyncCallsQueue``."""

    def __init__(self, request: Any) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue()
        self.queue.schedule_async_request(request)

    def finish(self, blocking: bool) -> bool:
        self.queue.maybe_finalize_async_calls(blocking=blocking)
        if self.queue.get_num_unfinalized_calls():
            return False
        self.queue.close()
        return True
