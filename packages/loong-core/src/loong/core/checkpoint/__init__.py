"""Checkpoints: atomic step directories with a manifest (:mod:`.manager`, :mod:`.manifest`) and the
per-rank RNG states a bit-exact continuation needs (:mod:`.rng`)."""

from loong.core.checkpoint.manager import (
    CONFIG_FILE,
    LATEST,
    STATE_FILE,
    CheckpointManager,
    newest_good,
    read_config,
    read_state,
    resolve_checkpoint,
    step_dir_name,
    step_dirs,
    verify_checkpoint,
    write_text_atomic,
)
from loong.core.checkpoint.manifest import MANIFEST, build_manifest, checkpoint_problem
from loong.core.checkpoint.rng import load_rng_states, save_rng_states

__all__ = [
    "CONFIG_FILE", "LATEST", "MANIFEST", "STATE_FILE", "CheckpointManager", "build_manifest",
    "checkpoint_problem", "load_rng_states", "newest_good", "read_config", "read_state",
    "resolve_checkpoint", "save_rng_states", "step_dir_name", "step_dirs", "verify_checkpoint",
    "write_text_atomic",
]
