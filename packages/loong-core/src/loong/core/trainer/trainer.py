"""One training loop for every task: accumulation is the engine's, cadence and safety are here."""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loong.core.accelerators.base import Accelerator
from loong.core.checkpoint import (
    CheckpointManager,
    load_rng_states,
    newest_good,
    read_config,
    read_state,
    save_rng_states,
)
from loong.core.config.schema import RunConfig
from loong.core.engines.base import Engine
from loong.core.errors import LoongError
from loong.core.parallel import ParallelLayout
from loong.core.task import Task
from loong.core.trainer.out_of_memory import out_of_memory_error
from loong.core.trainer.profiling import StepProfiler
from loong.core.trainer.reporting import Reporter
from loong.core.trainer.resilience import BatchSchedule, check_same_model, nonfinite_diagnostic


@dataclass
class TrainResult:
    """What a finished (or interrupted) run produced."""

    run_dir: Path
    last_step: int
    first_loss: float | None
    last_loss: float | None
    checkpoint: Path | None
    interrupted: bool = False
    loss_png: Path | None = None
    hf_dir: Path | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    is_logging_rank: bool = True
    #: the run directory's checkpoint was already at ``train.steps``: nothing was trained or written
    already_finished: bool = False
    #: whether rerunning the same command continues this run (not with ``train.resume=none``)
    rerun_continues: bool = True


class _StopFlag:
    """SIGTERM / SIGINT set a flag; the loop saves and exits at the next step boundary."""

    def __init__(self) -> None:
        self.raised = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        self.raised = True

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


class Trainer:
    """Runs ``engine`` on ``task`` for ``cfg.train.steps`` steps with logging, eval and checkpoints."""

    def __init__(self, cfg: RunConfig, config_dict: dict, task: Task, engine: Engine,
                 layout: ParallelLayout, accelerator: Accelerator, run_dir: Path) -> None:
        self.cfg, self.config_dict, self.task, self.engine = cfg, config_dict, task, engine
        self.layout, self.accelerator, self.run_dir = layout, accelerator, run_dir
        self.checkpoints = CheckpointManager(run_dir / "checkpoints", keep_last=cfg.train.keep_last,
                                             checksums=cfg.train.checkpoint_checksums)
        self.batches = BatchSchedule()
        self.nonfinite_steps = 0
        self.restore_notes: list[str] = []  # what a resume could not carry over (printed by the caller)

    # --- resume ------------------------------------------------------------------------------
    def restore(self, step_dir: Path) -> int:
        """Load a checkpoint into the engine; returns the step to continue from.

        A weights-only checkpoint (``convert`` of an HF folder) starts a fresh run from its weights.
        Everything else continues exactly: model, optimiser, scheduler, task state (e.g. the data
        balancer's fitted cost), skipped batches, and every RNG stream of this rank.
        """
        state = read_state(step_dir)
        if state.get("weights_only"):
            self.engine.load(step_dir, load_optimizer=False, allow_missing=True)
            return 0
        check_same_model(step_dir, read_config(step_dir).get("model", {}), self.config_dict.get("model", {}))
        self.engine.check_resume_layout(state.get("layout", {}))
        self.engine.load(step_dir)
        self.engine.load_scheduler_state(state.get("scheduler", {}))
        self.task.load_state_dict(state.get("task", {}))
        self.batches = BatchSchedule(state.get("data", {}).get("skipped_batches", []) + self.batches.skipped)
        self.nonfinite_steps = max(self.nonfinite_steps, int(state.get("nonfinite_steps", 0)))
        why = load_rng_states(step_dir, self.engine.set_rng_state)
        self.restore_notes = [f"RNG streams start afresh: {why}"] if why else []
        return int(state["step"])

    def _state(self, step: int, loss: float | None) -> dict[str, Any]:
        return {
            "step": step,
            "consumed_samples": step * self.cfg.train.global_batch_size,
            "loss": loss,
            "scheduler": self.engine.scheduler_state(),
            "loss_scale": self.engine.loss_scale(),
            "task": self.task.state_dict(),
            "data": {"next_batch": self.batches.batch(step), "skipped_batches": self.batches.skipped},
            "nonfinite_steps": self.nonfinite_steps,
            "layout": self.engine.layout_record(),
        }

    def save(self, step: int, loss: float | None) -> Path:
        """Collective checkpoint of the current state (returns before the write ends with async_save)."""
        return self.checkpoints.save(step, self.engine, self._state(step, loss), self.config_dict,
                                     artifacts=self.task.save_artifacts,
                                     every_rank=lambda d: save_rng_states(d, self.engine.rng_state()),
                                     async_save=self.cfg.train.async_save)

    def _on_nonfinite(self, step: int, batch: int, metrics: Any, reporter: Reporter) -> int:
        """Apply ``train.on_nonfinite`` to a step whose loss or gradients were NaN/Inf; returns the
        step to continue from."""
        policy = self.cfg.train.on_nonfinite
        self.nonfinite_steps += 1
        diag = nonfinite_diagnostic(step + 1, batch, metrics)
        if policy == "skip":
            reporter.print(f"skipped {diag} (train.on_nonfinite=skip; {self.nonfinite_steps} so far)")
            reporter.log({"step": step + 1, "nonfinite_skipped": self.nonfinite_steps})
            return step + 1
        if policy == "rollback":
            self.checkpoints.wait()
            last = self.checkpoints.latest()
            if last is None:
                raise LoongError(f"{diag}; train.on_nonfinite=rollback found no checkpoint to return to "
                                 "(set train.save_interval)")
            self.batches.skip(batch)
            resumed = self.restore(last)
            reporter.print(f"{diag}: rolled back to {last.name} and skipping global batch {batch}")
            reporter.log({"step": step + 1, "rollback_to": resumed, "skipped_batch": batch})
            return resumed
        raise LoongError(f"{diag}; stopped (train.on_nonfinite=stop). The last checkpoint is intact; "
                         "train.on_nonfinite=skip or rollback continues past such steps")

    def _out_of_memory(self, step: int, error: BaseException) -> LoongError:
        """The clear error for an out-of-memory in ``step``: what would fit, and which checkpoint is intact."""
        hints = self.engine.memory_hints(self.task.memory_hints())
        # no collective here (the other ranks may be inside the step): the newest finished checkpoint on disk, by sizes
        last, _ = newest_good(self.checkpoints.root, checksums=False)
        device = self.accelerator.device(self.layout.local_rank).type
        return out_of_memory_error(step, error, hints, device, last)

    # --- loop --------------------------------------------------------------------------------
    def _any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank (signals may reach ranks unevenly)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.accelerator.device(self.layout.local_rank))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def fit(self, start_step: int = 0) -> TrainResult:
        """Train from ``start_step`` to ``train.steps``."""
        t = self.cfg.train
        logging_rank = self.layout.is_logging_rank
        reporter = Reporter(self.run_dir, t.steps, start_step, logging_rank, t.progress)
        profiler = StepProfiler(list(t.profile_steps), self.run_dir, logging_rank,
                                self.accelerator.device(self.layout.local_rank).type)
        try:
            tokens_per_step = self.task.tokens_per_step()
            flops_per_token = self.task.flops_per_token()
            peak = self.accelerator.peak_flops(self.engine.dtype)
            peak_total = peak * self.layout.world_size if peak else None
            first_loss = last_loss = None
            last_ckpt: Path | None = None
            interrupted = False
            self.accelerator.reset_peak_memory()
            started = time.perf_counter()
            step = start_step
            window_tokens, window_start = 0, time.perf_counter()
            task_metrics: dict[str, float] = {}  # kept until the next logged step
            with _StopFlag() as stop:
                while step < t.steps:
                    self.checkpoints.poll()
                    batch = self.batches.batch(step)
                    profiler.before_step(step + 1)
                    try:
                        metrics = self.engine.train_step(batch)
                    except torch.OutOfMemoryError as error:
                        raise self._out_of_memory(step + 1, error) from error
                    profiler.after_step(step + 1, self.accelerator.synchronize)
                    if metrics.nonfinite:
                        step = self._on_nonfinite(step, batch, metrics, reporter)
                        continue
                    task_metrics.update(self.task.after_train_step(batch, metrics.extra))
                    step += 1
                    if not math.isnan(metrics.loss):
                        first_loss = metrics.loss if first_loss is None else first_loss
                        last_loss = metrics.loss
                    window_tokens += tokens_per_step
                    if step % t.log_interval == 0 or step == t.steps:
                        self.accelerator.synchronize()
                        elapsed = time.perf_counter() - window_start
                        tps = window_tokens / elapsed if elapsed > 0 else 0.0
                        mfu = tps * flops_per_token / peak_total if (peak_total and flops_per_token) else None
                        record = {"step": step, "train_loss": metrics.loss, "lr": metrics.lr,
                                  "tokens_per_s": round(tps, 1)}
                        if metrics.grad_norm is not None:
                            record["grad_norm"] = metrics.grad_norm
                        if mfu is not None:
                            record["mfu"] = round(mfu, 4)
                        record.update(task_metrics)
                        task_metrics = {}
                        mem = self.accelerator.max_memory_allocated()
                        if mem is not None:
                            record["peak_memory_gib"] = round(mem / 2**30, 2)
                        reporter.log(record)
                        reporter.advance(step, metrics.loss, tps, mfu)
                        window_tokens, window_start = 0, time.perf_counter()
                    if t.eval_interval and step % t.eval_interval == 0 and step < t.steps:
                        reporter.log({"step": step, "eval_loss": self.engine.eval_loss(t.eval_iters)})
                    if t.save_interval and step % t.save_interval == 0 and step < t.steps:
                        last_ckpt = self.save(step, last_loss)
                    out_of_time = bool(t.time_limit_s) and time.perf_counter() - started > t.time_limit_s
                    if self._any(stop.raised or out_of_time):
                        interrupted = stop.raised
                        reporter.print(f"stopping at step {step}: "
                                       f"{'signal received' if stop.raised else 'train.time_limit_s reached'}")
                        break
                eval_loss = self.engine.eval_loss(t.eval_iters) if t.eval_iters else None
                if eval_loss is not None:
                    reporter.log({"step": step, "eval_loss": eval_loss})
                profiler.close()
                for path in profiler.written:
                    reporter.print(f"profile: {path}")
                if t.save_final or step < t.steps:  # a run stopped early always saves
                    last_ckpt = self.save(step, last_loss)
                self.checkpoints.wait()
            hf_dir = None
            if t.save_hf and not interrupted:
                hf_dir = self.task.export(self.engine.export_model(), self.run_dir / "hf")
        except BaseException:
            profiler.close()
            reporter.close(plot=False)  # release files and TensorBoard on any failure
            raise
        png = reporter.close()
        wall = time.perf_counter() - started
        summary = {"steps": step - start_step, "wall_s": round(wall, 2),
                   "tokens_per_s": round((step - start_step) * tokens_per_step / wall, 1) if wall else None}
        return TrainResult(self.run_dir, step, first_loss, last_loss, last_ckpt, interrupted, png, hf_dir,
                           summary, is_logging_rank=logging_rank)
