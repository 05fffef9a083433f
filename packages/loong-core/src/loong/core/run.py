"""The walk of one training run: config → accelerator → process groups → task → engine → trainer.

Engine-neutral: the engine class named by ``engine`` (and required by the task) sets up its own groups, seeds
and adaptations; nothing here imports an engine's library.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loong.core.accelerators import select_accelerator
from loong.core.checkpoint import newest_good, read_config, read_state, resolve_checkpoint, verify_checkpoint
from loong.core.config import compose_config, from_dict, to_dict
from loong.core.engines.base import num_microbatches
from loong.core.errors import LoongError
from loong.core.registry import ENGINES, TASKS
from loong.core.run_dir import fresh_start, new_run_note, run_directory
from loong.core.trainer import Trainer, TrainResult


def _find_resume(cfg: Any, run_dir: Path, echo: Any) -> Path | None:
    """The checkpoint to continue from (collective: ranks share the checksum work).

    ``auto``: the run directory's newest good checkpoint. A path: that checkpoint, except that a weights-only one
    (``convert``'s output, a starting point rather than a state) gives way to the run's own newest checkpoint once
    the run has one, so that rerunning the command continues the run instead of starting it again.
    """
    resume = cfg.train.resume
    checksums = cfg.train.checkpoint_checksums
    if fresh_start(cfg):
        return None

    def own() -> Path | None:
        found, skipped = newest_good(run_dir / "checkpoints", checksums)
        for step_dir, why in skipped:
            echo(f"skipping checkpoint {step_dir.name}: {why}")
        return found

    if resume == "auto":
        return own()
    step_dir = resolve_checkpoint(resume, verify=False)
    verify_checkpoint(step_dir, checksums)
    if read_state(step_dir).get("weights_only") and (mine := own()) is not None:
        echo(f"train.resume={resume} started this run; continuing its own newest checkpoint")
        return mine
    return step_dir


def _finished(cfg: Any, run_dir: Path, checkpoint: Path | None) -> int | None:
    """The step of ``checkpoint`` when it leaves nothing to train (at or past ``train.steps``), else None.

    The run's own checkpoint: a finished run (the caller says so and returns). Another run's, named by
    ``train.resume``: an error, since the run asked for cannot continue from it."""
    if checkpoint is None:
        return None
    state = read_state(checkpoint)
    step = int(state["step"])
    if state.get("weights_only") or step == 0 or step < cfg.train.steps:
        return None
    if checkpoint.parent.resolve() != (run_dir / "checkpoints").resolve():
        raise LoongError(f"{checkpoint} is already at step {step} >= train.steps={cfg.train.steps}; raise "
                         "train.steps to continue")
    return step


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
        saved = read_config(step_dir)
        model = saved.get("model") if isinstance(saved, dict) else None
        try:  # the overrides were checked above: what fails here is the checkpoint's model (another modality's)
            if not isinstance(model, dict):
                raise LoongError("its config has no model section")
            plain["model"] = _with_model_overrides(model, overrides)
            cfg = from_dict(schema, plain)
        except LoongError as exc:
            raise LoongError(f"train.resume: {step_dir} is not a checkpoint of this CLI's models ({exc})") from None
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
        clean = False
        try:
            log = echo if layout.is_logging_rank else (lambda _m: None)
            num_microbatches(cfg, layout.dp)  # batch sizes that do not divide over dp fail before any data or model
            run_dir = run_directory(cfg, plain)
            checkpoint = _find_resume(cfg, run_dir, log)
            done = _finished(cfg, run_dir, checkpoint)
            if done is not None:
                log(f"{run_dir} is finished: its checkpoint {checkpoint.name} is at step {done} of train.steps="
                    f"{cfg.train.steps}; nothing to train (raise train.steps to continue it, or train.resume=none "
                    "for a new run)")
                clean = True
                return TrainResult(run_dir, done, None, None, checkpoint, already_finished=True,
                                   is_logging_rank=layout.is_logging_rank)
            if checkpoint is None and layout.is_logging_rank and (note := new_run_note(cfg, plain, run_dir)):
                log(note)
            engine_cls.seed(cfg.train.seed, accelerator, layout)
            task = task_cls(cfg, accelerator, layout)
            task.setup_data()
            task.run_dir = run_dir
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
            result = trainer.fit(start)
            result.rerun_continues = not fresh_start(cfg)
            clean = True
            return result
        finally:
            engine_cls.shutdown(layout, clean=clean)
