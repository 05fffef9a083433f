"""The walk of one training run: config → accelerator → process groups → task → engine → trainer.

Engine-neutral: the engine class named by ``engine`` (and required by the task) sets up its own groups, seeds
and adaptations; nothing here imports an engine's library.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from loong.core.accelerators import select_accelerator
from loong.core.checkpoint import newest_good, read_config, read_state, resolve_checkpoint, verify_checkpoint
from loong.core.config import compose_config, from_dict, to_dict
from loong.core.errors import LoongError
from loong.core.registry import ENGINES, TASKS
from loong.core.trainer import Trainer, TrainResult


def _run_dir(cfg: Any) -> Path:
    name = cfg.run_name
    if name is None:
        preset = getattr(cfg.model, "preset", None) or "run"
        # A launcher that may restart the run (--max-restarts) fixes the stamp for every attempt.
        stamp = [f"{preset}-{os.environ.get('LOONG_RUN_STAMP') or time.strftime('%Y%m%d-%H%M%S')}"]
        if dist.is_initialized():
            dist.broadcast_object_list(stamp, src=0)  # one name for every rank
        name = stamp[0]
    return Path(cfg.output_dir) / name


def _find_resume(cfg: Any, run_dir: Path, echo: Any) -> Path | None:
    """The checkpoint to continue from (collective: ranks share the checksum work)."""
    resume = cfg.train.resume
    checksums = cfg.train.checkpoint_checksums
    if resume in ("none", "never", ""):
        return None
    if resume == "auto":
        found, skipped = newest_good(run_dir / "checkpoints", checksums)
        for step_dir, why in skipped:
            echo(f"skipping checkpoint {step_dir.name}: {why}")
        return found
    step_dir = resolve_checkpoint(resume, verify=False)
    verify_checkpoint(step_dir, checksums)
    return step_dir


def _with_model_overrides(model: dict, overrides: list[str]) -> dict:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    node = OmegaConf.create(model)
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.key_or_group.startswith("model."):
            OmegaConf.update(node, o.key_or_group[len("model."):], o.value(), force_add=True)
    return OmegaConf.to_container(node)


def train(config_module: str, config_name: str, overrides: list[str], schema: type,
          echo: Any = print) -> TrainResult:
    """Compose the config and run it to the end. Bad input raises LoongError before anything is written."""
    cfg, plain = compose_config(config_module, config_name, overrides, schema)
    if cfg.train.resume not in ("auto", "none", "never", ""):
        # An explicit checkpoint defines the model it holds (e.g. one made by `convert`); model.*
        # keys given on the command line (e.g. model.lora.rank=8) still win.
        step_dir = resolve_checkpoint(cfg.train.resume, verify=False)  # checksums: after dist init
        plain["model"] = _with_model_overrides(read_config(step_dir)["model"], overrides)
        cfg = from_dict(schema, plain)
    return run(cfg, echo)


def run(cfg: Any, echo: Any = print) -> TrainResult:
    """Run an already composed and validated config (a ``RunConfig`` subclass) to the end: the walk without
    Hydra, for tools and tests that build their config in code."""
    task_cls = TASKS.get(cfg.task)
    if task_cls.engine != cfg.engine:
        raise LoongError(f"engine: task {cfg.task!r} runs on the {task_cls.engine!r} engine, not {cfg.engine!r}; "
                         f"set engine={task_cls.engine}")
    engine_cls = ENGINES.get(cfg.engine)
    engine_cls.check_config(cfg)
    task_cls.check_config(cfg)  # may complete the config (e.g. the model shape of an HF folder)
    plain = to_dict(cfg)
    accelerator = select_accelerator()
    with engine_cls.activate(accelerator):
        layout = engine_cls.init_layout(accelerator, cfg)
        try:
            engine_cls.seed(cfg.train.seed, accelerator, layout)
            task = task_cls(cfg, accelerator, layout)
            task.setup_data()
            run_dir = task.run_dir = _run_dir(cfg)
            checkpoint = _find_resume(cfg, run_dir, echo if layout.is_logging_rank else (lambda _m: None))
            if checkpoint is not None and 0 < read_state(checkpoint)["step"] >= cfg.train.steps:
                raise LoongError(
                    f"{checkpoint} is already at step {read_state(checkpoint)['step']} >= "
                    f"train.steps={cfg.train.steps}; raise train.steps to continue"
                )
            engine = engine_cls(task, cfg, accelerator, layout, fresh=checkpoint is None)
            trainer = Trainer(cfg, plain, task, engine, layout, accelerator, run_dir)
            start = 0
            if checkpoint is not None:
                start = trainer.restore(checkpoint)
                if layout.is_logging_rank:
                    echo(f"resumed from {checkpoint} at step {start}")
                    for note in trainer.restore_notes:
                        echo(note)
            if layout.is_logging_rank:
                echo(f"run directory: {run_dir}  ({accelerator.name}, {cfg.engine} engine, world "
                     f"{layout.world_size}: {layout.describe()})")
            return trainer.fit(start)
        finally:
            engine_cls.shutdown(layout)
