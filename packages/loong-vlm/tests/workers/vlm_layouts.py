"""VLM layout checks, run as ``torchrun --nproc-per-node 2 vlm_layouts.py ROOT``.

One 2-process gloo launch (process start-up dominates CI time), the tiny VLM (``model=tiny``: Qwen2.5-VL's ViT
and merger over a Qwen2 foundation with M-RoPE) on the synthetic shapes set, fp32:

- the loss and every gradient (gathered whole) of one step at DP=2 (the reference in this world), foundation TP=2,
  TP=2 with sequence parallelism (the encoder unsharded on each TP rank), foundation and encoder TP=2
  (``encoder.parallel.tp=2``: the ViT's blocks sharded), PP=2 (the encoder on the first stage),
  PP=2 with ``encoder.decoupled=true`` (the tower on every stage, outside the schedule),
  and with ``data.balance.enabled=true`` at DP=2 (plus the plan's predicted max/mean rank cost before and after);
  the tiny Qwen3-VL-MoE (DeepStack, interleaved M-RoPE) at DP=2, at EP=2 and at TP=2 with its Qwen3 ViT at TP=2;
- every encoder family's blocks sharded over the two ranks against themselves unsharded (``workers/encoder_tp.py``);
- at TP=2 with the encoder sharded, ``train.save_hf``'s HF folder and ``model.init_from_hf`` from it against the
  whole weights;
- 10 training steps at DP=2, TP=2 with the encoder at TP=2, PP=2, PP=2 decoupled and CP=2; TP=2 (encoder too) saves
  a checkpoint at step 5 that DP=2 (all TP=1) resumes for two steps, and resumes DP=2's the same way; PP=2 decoupled
  saves one that the coupled PP=2 resumes, and back (the gradient norms of every DP=2 and TP=2 step recorded);
- 2 steps at PP=2 decoupled and at TP=2 with the encoder sharded, with ``model.freeze=[encoder]`` (which
  parameters the optimiser holds, on each rank);
- 4 balanced steps with ``data.balance.cost=fit`` (per-step balance metrics, one fit with the encoder terms).

Every layout starts from the DP=2 run's initial weights (megatron's random initialisation differs between pipeline
and expert layouts: each rank draws only its own layers and experts), loaded whole into each layout's shards.
Rank 0 saves everything, those weights included, to ``ROOT/result.pt`` (``torch.save``); the pytest side compares
(and runs the DP=1 reference in its own process). The helpers
(:func:`build`, :func:`one_step`, :func:`fit_and_losses`) also serve the single-process tests.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from encoder_tp import encoder_tp_parity

from loong.core.accelerators import select_accelerator
from loong.core.config import compose_config
from loong.core.config.schema import to_dict
from loong.core.engines.megatron.engine import MegatronEngine
from loong.core.engines.megatron.layout import init_distributed
from loong.core.engines.megatron.state import gather_full_state, load_full_state
from loong.core.trainer import Trainer
from loong.vlm.schema import VLMRunConfig
from loong.vlm.task import VLMTask

STEPS = 10
SAVE_AT = 5
RESUMED_STEPS = SAVE_AT + 2  # the TP=2 <-> TP=1 resumes: the next loss and the one after
#: a small, fast run: 64 synthetic samples, rows of 128 slots, 4 rows a step (2 micro-batches a DP rank at DP=2)
COMMON = ["data.synthetic_size=64", "data.valid_fraction=0", "train.seq_length=128", "train.global_batch_size=4",
          "train.micro_batch_size=1", "train.eval_iters=0", "train.eval_interval=0", "train.progress=false",
          "train.precision=fp32", "train.warmup_steps=0", "train.lr_decay_style=constant", "train.lr=1e-3"]
LAYOUTS = {
    "dp2": ["parallel.tp=1"],
    "tp2": ["parallel.tp=2"],
    "tp2sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "tp2_enc_tp2": ["parallel.tp=2", "encoder.parallel.tp=2"],
    "pp2": ["parallel.pp=2"],
    "pp2_decoupled": ["parallel.pp=2", "encoder.decoupled=true"],
    "cp2": ["parallel.cp=2"],
    "balanced": ["parallel.tp=1", "data.balance.enabled=true"],
    "moe_dp2": ["model=tiny_qwen3_vl_moe", "parallel.tp=1"],
    "moe_ep2": ["model=tiny_qwen3_vl_moe", "parallel.ep=2"],
    "moe_tp2_enc_tp2": ["model=tiny_qwen3_vl_moe", "parallel.tp=2", "encoder.parallel.tp=2"],
}


def build(root: Path, overrides: list[str], acc, steps: int = STEPS):  # noqa: ANN001, ANN201
    """Config, layout and data-ready task of a small VLM run under ``root`` (the data caches are shared)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cfg, _ = compose_config("loong.vlm.configs", "train",
                            [f"output_dir={root}", f"train.steps={steps}", *COMMON, *overrides], VLMRunConfig)
    VLMTask.check_config(cfg)
    layout = init_distributed(acc, cfg.parallel, VLMTask.component_layouts(cfg))
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    task = VLMTask(cfg, acc, layout)
    task.setup_data()
    return cfg, layout, task


def one_step(root: Path, overrides: list[str], acc, weights: dict | None = None,  # noqa: ANN001
             probe: Callable[[MegatronEngine], dict] | None = None) -> dict:
    """The loss and whole gradients of step 0 (no optimiser step) from ``weights`` (None: the layout's own
    initialisation), the same on every rank; ``weights``: the whole initial weights used. ``probe(engine)``, called
    on every rank after the step's backward, adds its figures to the result."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    get_moe_metrics_tracker().clear()
    cfg, layout, task = build(root, overrides, acc)
    engine = MegatronEngine(task, cfg, acc, layout)
    if weights is not None:
        load_full_state(engine.model_chunks, weights)
    else:
        weights = gather_full_state(engine.model_chunks)
    for m in engine.model_chunks:
        m.zero_grad_buffer()
    nmb = task.num_train_microbatches(0, engine.num_microbatches)
    loss = engine._run(engine._iterators(lambda: task.train_microbatches(0, nmb)), forward_only=False,
                       num_microbatches=nmb)
    grads = gather_full_state(engine.model_chunks, source=lambda p: p.main_grad)
    loss_t = torch.tensor([loss if layout.is_logging_rank else float("-inf")])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(loss_t, op=dist.ReduceOp.MAX)
    out = {"loss": float(loss_t), "grads": grads, "nmb": nmb, "weights": weights}
    if probe is not None:
        out.update(probe(engine))
    if layout.dp == layout.world_size > 1:  # which samples each DP rank trained on
        if task.balanced is not None:
            out["metrics"] = task.balanced.step_metrics(0)
            mine = sorted(s for mb in task.balanced.rows(0, layout.dp_rank) for row, _ in mb for s in row)
        else:
            train = task.data.train
            rows = task._rows(0, nmb, len(train), True)
            mine = sorted(s for mb in rows for r in mb for s in train.packed.bins[r])
        out["samples"] = [None] * layout.world_size
        dist.all_gather_object(out["samples"], mine)
    return out


def fit_and_losses(cfg, layout, task, acc, run_dir: Path, resume: Path | None = None,  # noqa: ANN001, ANN201
                   weights: dict | None = None):
    """Train from ``weights`` (or resume) to ``train.steps``; every step's loss (-inf: not run here) and the
    metrics records (``grad_norm`` among them), on every rank, and the engine."""
    engine = MegatronEngine(task, cfg, acc, layout, fresh=resume is None)
    if weights is not None and resume is None:
        load_full_state(engine.model_chunks, weights)
    trainer = Trainer(cfg, to_dict(cfg), task, engine, layout, acc, run_dir)
    trainer.fit(trainer.restore(resume) if resume is not None else 0)
    records: list = []
    if layout.is_logging_rank:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        holder: list = [None] * dist.get_world_size()
        dist.all_gather_object(holder, records)
        records = next(r for r in holder if r)
    losses = [float("-inf")] * cfg.train.steps
    for rec in records:
        if "train_loss" in rec:
            losses[rec["step"] - 1] = rec["train_loss"]
    return losses, records, engine


def frozen_encoder(root: Path, acc, weights: dict, name: str) -> dict:  # noqa: ANN001
    """Two steps at layout ``name`` (PP=2 with the decoupled tower; TP=2 with the encoder sharded) with
    ``model.freeze=[encoder]``: per component, on every rank, whether any of its parameters is in the optimiser,
    holds Adam state, or changed; and whether its replica is here (gathered from every rank)."""
    from loong.core.engines.megatron.state import unwrap

    cfg, layout, task = build(root, [*LAYOUTS[name], "model.freeze=[encoder]"], acc, steps=2)
    engine = MegatronEngine(task, cfg, acc, layout)
    load_full_state(engine.model_chunks, weights)
    model = unwrap(engine.model_chunks[0])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(2):
        assert not engine.train_step(step).skipped
    in_optimizer = {id(q) for g in engine.optimizer.param_groups for q in g["params"]}
    with_state = {id(q) for opt in engine._torch_adams() for q in opt.state}
    mine: dict = {}
    for name, p in model.named_parameters():
        part = mine.setdefault(name.split(".", 1)[0], {"optimizer": False, "state": False, "changed": False})
        part["optimizer"] |= id(p) in in_optimizer
        part["state"] |= id(p) in with_state
        part["changed"] |= not torch.equal(p.detach(), before[name])
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone}


def hf_round_trip(root: Path, acc, weights: dict) -> dict:  # noqa: ANN001
    """At TP=2 with the encoder sharded (``tp2_enc_tp2``): ``train.save_hf``'s export of the initial ``weights``
    read back whole (its native state against ``weights``), and a model built from that folder with
    ``model.init_from_hf`` gathered whole against ``weights``: the largest absolute difference of each, and the
    encoder tensors the folder holds."""
    from loong.vlm.hf import read_hf_state
    from loong.vlm.hf_config import VLMParts

    folder = root / "hf_enc_tp2"
    cfg, layout, task = build(root, LAYOUTS["tp2_enc_tp2"], acc)
    engine = MegatronEngine(task, cfg, acc, layout)
    load_full_state(engine.model_chunks, weights)
    task.export(engine.model_chunks, folder)
    written = read_hf_state(folder, VLMParts.of(cfg))
    cfg, layout, task = build(root, [*LAYOUTS["tp2_enc_tp2"], f"model.init_from_hf={folder}"], acc)
    loaded = gather_full_state(MegatronEngine(task, cfg, acc, layout).model_chunks)

    def diff(got: dict) -> float:
        return max(float((got[k] - weights[k]).abs().max()) for k in got if k in weights)

    return {"export_err": diff(written), "init_err": diff(loaded), "loaded_keys_equal": sorted(loaded) == sorted(weights),
            "encoder_shapes_whole": all(tuple(written[k].shape) == tuple(weights[k].shape)
                                        for k in weights if k.startswith("encoder.")),
            "encoder_keys": sum(k.startswith("encoder.") for k in written)}


def _step_dir(root: Path, run: str) -> Path:
    """The step-``SAVE_AT`` checkpoint of the run under ``root / run``."""
    return root / run / "checkpoints" / f"step_{SAVE_AT:08d}"


def _grad_norms(records: list) -> list[float]:
    """The gradient norm (before clipping) of every logged training step."""
    return [r["grad_norm"] for r in records if "train_loss" in r]


def _grad_err(got: dict, ref: dict) -> float:
    return max(float((got[k] - g).abs().max() / g.abs().max().clamp(min=1e-12)) for k, g in ref.items())


def main() -> None:
    root = Path(sys.argv[1])
    acc = select_accelerator("cpu")
    result: dict = {"loss": {}, "grad_err": {}, "grad_keys_equal": {}, "train": {}, "nmb": {}}
    with acc.activate(engine="megatron"):
        refs: dict = {}
        for name, overrides in LAYOUTS.items():
            family = "moe" if name.startswith("moe") else "dense"
            got = one_step(root, overrides, acc, refs[family]["weights"] if family in refs else None)
            result["loss"][name], result["nmb"][name] = got["loss"], got["nmb"]
            ref = refs.setdefault(family, got)
            result["grad_keys_equal"][name] = sorted(got["grads"]) == sorted(ref["grads"])
            result["grad_err"][name] = _grad_err(got["grads"], ref["grads"])
            if "samples" in got:
                result.setdefault("samples", {})[name] = got["samples"]
            if name == "balanced":
                result["balance_metrics"] = got["metrics"]
        weights = refs["dense"]["weights"]
        result["dp2_step"] = {k: refs["dense"][k] for k in ("loss", "grads", "weights")}
        for name in ("dp2", "pp2"):  # they save at step 5 for the encoder-TP and decoupled resumes below
            cfg, layout, task = build(root, [*LAYOUTS[name], f"train.save_interval={SAVE_AT}"], acc)
            losses, records, _ = fit_and_losses(cfg, layout, task, acc, root / name, weights=weights)
            result["train"][name] = losses
            if name == "dp2":
                dp2_grad_norms = _grad_norms(records)
        # the decoupled tower trains as pp2, saves at step 5, and the coupled pp2 resumes from its checkpoint
        cfg, layout, task = build(root, [*LAYOUTS["pp2_decoupled"], f"train.save_interval={SAVE_AT}"], acc)
        result["train"]["pp2_decoupled"] = fit_and_losses(cfg, layout, task, acc, root / "pp2_decoupled",
                                                          weights=weights)[0]
        ckpt = root / "pp2_decoupled" / "checkpoints" / f"step_{SAVE_AT:08d}"
        cfg, layout, task = build(root, LAYOUTS["pp2"], acc)
        result["train"]["pp2_resumed_from_decoupled"] = fit_and_losses(cfg, layout, task, acc,
                                                                       root / "resumed_coupled", ckpt)[0]
        cfg, layout, task = build(root, LAYOUTS["pp2_decoupled"], acc)  # and back: coupled -> decoupled
        result["train"]["decoupled_resumed_from_pp2"] = fit_and_losses(
            cfg, layout, task, acc, root / "resumed_decoupled", root / "pp2" / "checkpoints" / f"step_{SAVE_AT:08d}")[0]
        cfg, layout, task = build(root, LAYOUTS["cp2"], acc)
        result["train"]["cp2"] = fit_and_losses(cfg, layout, task, acc, root / "cp2", weights=weights)[0]
        # TP=2, the encoder sharded too: 10 steps from the same weights; its step-5 checkpoint resumed at TP=1 (DP=2),
        # and DP=2's step-5 checkpoint resumed at TP=2 (the foundation-TP=2 resume with the encoder unsharded is this
        # one's foundation half: one 10-step run serves both, to keep the launch short)
        cfg, layout, task = build(root, [*LAYOUTS["tp2_enc_tp2"], f"train.save_interval={SAVE_AT}"], acc)
        losses, records, _ = fit_and_losses(cfg, layout, task, acc, root / "tp2_enc_tp2", weights=weights)
        result["train"]["tp2_enc_tp2"] = losses
        result["grad_norm"] = {"dp2": dp2_grad_norms, "tp2_enc_tp2": _grad_norms(records)}
        for name, saved, resumed in (("dp2", "tp2_enc_tp2", "dp2_resumed_from_enc_tp2"),
                                     ("tp2_enc_tp2", "dp2", "enc_tp2_resumed_from_dp2")):
            # two steps after the checkpoint: the next loss (its weights) and the one after (its optimiser state)
            cfg, layout, task = build(root, LAYOUTS[name], acc, steps=RESUMED_STEPS)
            result["train"][resumed] = fit_and_losses(cfg, layout, task, acc, root / resumed, _step_dir(root, saved))[0]
        result["encoder_tp"] = encoder_tp_parity()
        result["hf_enc_tp2"] = hf_round_trip(root, acc, weights)
        result["frozen_decoupled"] = frozen_encoder(root, acc, weights, "pp2_decoupled")
        result["frozen_enc_tp2"] = frozen_encoder(root, acc, weights, "tp2_enc_tp2")
        fit = [*LAYOUTS["balanced"], "data.balance.cost=fit", "data.balance.fit_steps=2", "train.global_batch_size=8"]
        cfg, layout, task = build(root, fit, acc, steps=4)
        result["train"]["balanced_fit"], result["balanced_fit_records"], _ = fit_and_losses(
            cfg, layout, task, acc, root / "balanced_fit", weights=weights)
    if dist.get_rank() == 0:
        torch.save(result, root / "result.pt")


if __name__ == "__main__":
    main()
