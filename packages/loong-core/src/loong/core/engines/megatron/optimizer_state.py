"""The plain (non-distributed) optimiser's checkpoint state in one layout-independent form.

megatron-core builds a ``ChainedOptimizer`` of one optimiser per parameter kind: the dense parameters,
and — when expert parallelism is on (EP > 1) — the expert parameters in a second one. Its sharded state
dict then nests one dict per part and prefixes every tensor key with ``chained_<i>.``, while at EP = 1
(and for dense models) the single part's dict is written as is. The two shapes differ in their keys
*and* in their non-tensor entries (``param_groups``, the common Adam ``step``), so optimiser state saved
at one EP does not load at another.

Here the parts are merged into the single-optimiser shape — the one dense models and EP = 1 runs have
always written, so their checkpoints are unchanged — and read back at any layout:

- every Adam moment (and, with bf16, the fp32 main parameter) is a ShardedTensor keyed by the model
  parameter's sharded key (``optimizer.state.exp_avg.<key>``), a global tensor that any TP/PP/DP/EP
  layout slices its own way;
- the non-tensor entries are the common ``step`` and the hyperparameter groups; a loaded checkpoint
  contributes the step, and the groups (learning rate, betas, weight decay ...) are the run's own (the
  LR schedule's position comes from ``trainer_state.json``).

Checkpoints written before this form at EP > 1 (``chained_<i>.`` keys) are still read, at any layout:
each tensor is looked up under the prefix the checkpoint has it under.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase

from loong.core.errors import LoongError

# FP32Optimizer's state dict is torch's (``state``, ``param_groups``); Float16OptimizerWithFloat16Params
# nests it under ``optimizer`` beside the fp32 main parameters (and a grad scaler for fp16).
_FP16_KEY = "fp32_from_fp16_params"


def optimizer_parts(optimizer: Any) -> list[Any]:
    """The per-kind optimisers inside megatron's (chained) optimiser that own parameters."""
    parts = getattr(optimizer, "chained_optimizers", None)
    parts = list(parts) if parts is not None else [optimizer]
    return [p for p in parts if not getattr(p, "is_stub_optimizer", False)]


def _is_fp16_part(part_sd: dict) -> bool:
    return _FP16_KEY in part_sd


def _adam_sd(part_sd: dict) -> dict:
    """The torch-optimizer-shaped dict (``state`` + ``param_groups``) inside a part's state dict."""
    return part_sd["optimizer"] if _is_fp16_part(part_sd) else part_sd


def merged_sharded_state_dict(optimizer: Any, model_sd: dict, is_loading: bool) -> dict:
    """One single-optimiser-shaped sharded state dict for all parts of ``optimizer``.

    Each part is asked for its own sharded state dict (megatron's, unprefixed) and the parts are
    concatenated: state indices shifted past the earlier parts' parameters, one common ``step``, the
    hyperparameter groups in part order (their parameter lists are not saved: megatron marks them
    non-persistent). With one part it is exactly that part's state dict. For loading the groups are
    left out: the checkpoint's, from any layout, come back untouched beside this layout's tensors.
    """
    sync = getattr(optimizer, "_synchronize_steps", None)
    if sync is not None and not is_loading and len(getattr(optimizer, "chained_optimizers", [])) > 1:
        sync()  # as ChainedOptimizer.sharded_state_dict does (TE's FusedAdam keeps the step per group)
    parts = [p.sharded_state_dict(model_sd, is_loading=is_loading) for p in optimizer_parts(optimizer)]
    if is_loading:
        for part in parts:
            _adam_sd(part).pop("param_groups", None)
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return {"state": {}}
    fp16 = _is_fp16_part(parts[0])
    state: dict = {}
    groups: list = []
    fp32_params: list = []
    steps = []
    offset = 0
    for part, opt in zip(parts, optimizer_parts(optimizer), strict=True):
        adam = _adam_sd(part)
        for key, value in adam["state"].items():
            if key == "common_step":
                steps.append(value)
            else:
                state[offset + key] = value
        groups.extend(adam.get("param_groups", []))
        if fp16:
            fp32_params.extend(part[_FP16_KEY])
        offset += sum(len(g["params"]) for g in opt.optimizer.param_groups)
    if steps:
        state["common_step"] = steps[0]
    adam = {"state": state}
    if not is_loading:
        adam["param_groups"] = groups
    if not fp16:
        return adam
    merged = {"optimizer": adam, _FP16_KEY: fp32_params}
    if "grad_scaler" in parts[0]:
        merged["grad_scaler"] = parts[0]["grad_scaler"]
    return merged


def _legacy_prefixed(key: str, saved: set[str]) -> str | None:
    """The ``chained_<i>.``-prefixed key an older EP > 1 checkpoint has ``key``'s tensor under."""
    for i in range(8):
        for candidate in (f"chained_{i}.{key}", f"chained_{i}.{key}_w"):
            if candidate in saved:
                return candidate.removesuffix("_w") if candidate.endswith(f"{key}_w") else candidate
    return None


def match_saved_keys(sharded_sd: dict, saved: Iterable[str]) -> None:
    """Point each ShardedTensor (or factory) of ``sharded_sd`` at its key in the checkpoint, in place.

    Only keys the checkpoint lacks are touched: they are looked up under the ``chained_<i>.`` prefixes
    of checkpoints written before the layout-independent form (megatron's ChainedOptimizer at EP > 1).
    """
    saved = set(saved)
    for value in nested_values(sharded_sd):
        if not isinstance(value, ShardedBase):
            continue
        key = value.key
        if key in saved or f"{key}_w" in saved:  # SwiGLU factories save {key}_w / {key}_v
            continue
        legacy = _legacy_prefixed(key, saved)
        if legacy is not None:
            value.key = legacy


def _find_common_step(loaded: Any) -> Any:
    """The Adam ``step`` in a loaded optimiser dict of any shape (this form, or an older chained one)."""
    if isinstance(loaded, dict):
        if "common_step" in loaded:
            return loaded["common_step"]
        for value in loaded.values():
            found = _find_common_step(value)
            if found is not None:
                return found
    elif isinstance(loaded, list):
        for value in loaded:
            found = _find_common_step(value)
            if found is not None:
                return found
    return None


def _grad_scaler(loaded: Any) -> Any:
    if isinstance(loaded, dict):
        if "grad_scaler" in loaded:
            return loaded["grad_scaler"]
        for value in loaded.values():
            if isinstance(value, dict) and "grad_scaler" in value:
                return value["grad_scaler"]
    return None


def load_merged_state_dict(optimizer: Any, loaded: dict) -> None:
    """Load what :func:`merged_sharded_state_dict` (built with ``is_loading=True``) read back.

    ``loaded`` holds this layout's tensors in this layout's structure (the ShardedTensors decided
    where each came from) plus the checkpoint's non-tensor entries, whatever layout wrote them; only
    the step is taken from those, the parameter groups are this run's.
    """
    parts = optimizer_parts(optimizer)
    if not parts:
        return
    step = _find_common_step(loaded)
    scaler = _grad_scaler(loaded)
    fp16 = _FP16_KEY in loaded
    adam_loaded = loaded["optimizer"] if fp16 else loaded
    state = adam_loaded.get("state", {})
    fp32_params: Sequence = loaded.get(_FP16_KEY, [])
    offset, group_offset = 0, 0
    for part in parts:
        groups = part.optimizer.param_groups
        n = sum(len(g["params"]) for g in groups)
        part_groups, local = [], 0
        for g in groups:
            hyper = {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
            part_groups.append({**hyper, "params": list(range(local, local + len(g["params"])))})
            local += len(g["params"])
        part_state = {i: state[offset + i] for i in range(n) if (offset + i) in state}
        missing = [i for i in range(n) if (offset + i) not in state]
        if missing and part_state:
            raise LoongError(f"the checkpoint's optimiser state lacks {len(missing)} of {n} parameters")
        if step is not None and part_state:
            part_state["common_step"] = copy.deepcopy(step)
        adam = {"state": part_state, "param_groups": part_groups}
        if fp16:
            part_sd = {"optimizer": adam, _FP16_KEY: list(fp32_params[group_offset:group_offset + len(groups)])}
            if scaler is not None:
                part_sd["grad_scaler"] = scaler
        else:
            part_sd = adam
        part.load_state_dict(part_sd)
        offset += n
        group_offset += len(groups)
    sync = getattr(optimizer, "_synchronize_steps", None)
    if sync is not None and len(getattr(optimizer, "chained_optimizers", [])) > 1:
        sync()

