"""LoRA (``loong.llm.lora``): exact at step 0, only adapters train, merges exactly into HF weights,
TP=2 equals TP=1, checkpoints resume, ``convert --merge-lora`` end to end.

Every model starts from the ``tiny_llama_hf`` fixture (4 random LLaMA layers, fp32). In-process tests
build one model in a world of one; the training runs go through ``loong-llm train`` in-process; the
TP comparison is one 2-process gloo launch (``workers/lora_tp.py``).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loong.core.errors import LoongError
from loong.llm.models.config import LoraConfig

TOL = 1e-5
WORKER = Path(__file__).parent / "workers" / "lora_tp.py"
LORA = ["model.lora.rank=8", "model.lora.alpha=16"]
TRAIN = ["train.steps=8", "train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2",
         "train.eval_interval=0", "train.eval_iters=0", "train.progress=false", "train.lr=3e-2",
         "train.warmup_steps=0", "train.lr_decay_style=constant", "train.save_interval=4"]


# --- helpers ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _world() -> Iterator[tuple]:
    """A world of one on the CPU accelerator."""
    from loong.core.accelerators import select_accelerator
    from loong.core.engines.megatron.layout import world

    acc = select_accelerator("cpu")
    with world(acc) as layout:
        yield acc, layout


def _model(world: tuple, model_cfg) -> torch.nn.Module:  # noqa: ANN001
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from loong.core.config.schema import ParallelConfig
    from loong.llm.models.build import build_gpt_model, transformer_config

    acc, layout = world
    model_parallel_cuda_manual_seed(0)
    tc = transformer_config(model_cfg, ParallelConfig(), torch.float32, {"use_cpu_initialization": True})
    return build_gpt_model(model_cfg, tc, acc.capabilities(), True, True, layout.pg_collection).eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(tokens, torch.arange(48).unsqueeze(0).expand(2, -1), None)


def _hf_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    tokens = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return hf(tokens).logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _random_adapters(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {k: 0.2 * torch.randn(shapes[k], generator=g) for k in sorted(shapes)}


# --- in-process: one model, a world of one -----------------------------------------------------
def test_step0_equals_base_model_and_only_adapters_are_trainable(tiny_llama_hf: Path) -> None:
    from loong.llm.hf import load_hf_into, model_config_from_hf
    from loong.llm.lora import apply_lora, is_adapter_key

    with _world() as world:
        cfg = model_config_from_hf(tiny_llama_hf)
        model = _model(world, cfg)
        load_hf_into([model], tiny_llama_hf, cfg)
        base = _logits(model)
        adapted = apply_lora([model], LoraConfig(rank=4, alpha=8.0))
        assert len(adapted) == 4 * cfg.num_layers  # qkv, proj, fc1, fc2 in every layer
        assert torch.equal(_logits(model), base)  # B = 0: bit-identical
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trainable and all(is_adapter_key(n) for n in trainable)
        assert len(trainable) == 2 * len(adapted)


def test_merged_hf_folder_matches_loong_with_adapters(tiny_llama_hf: Path, tmp_path: Path) -> None:
    """merge_lora → native_to_hf → write_hf_folder → from_pretrained gives Loong's base+adapter logits."""
    from loong.core.engines.megatron.state import gather_full_state
    from loong.llm.hf import load_hf_into, model_config_from_hf
    from loong.llm.hf_io import write_hf_folder
    from loong.llm.lora import adapter_shapes, apply_lora, is_adapter_key, load_adapter_state, merge_lora
    from loong.llm.models.hf_mapping import family_by_name, native_to_hf

    with _world() as world:
        cfg = model_config_from_hf(tiny_llama_hf)
        cfg.lora = LoraConfig(rank=4, alpha=8.0, targets=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
        model = _model(world, cfg)
        apply_lora([model], cfg.lora)
        load_hf_into([model], tiny_llama_hf, cfg)  # skips the adapters
        base = _logits(model)
        load_adapter_state([model], _random_adapters(adapter_shapes([model])))
        loong = _logits(model)
        full = gather_full_state([model])
    assert _rel(loong, base) > 1e-2  # the adapters matter
    merged = merge_lora(full, cfg.lora)
    assert not any(is_adapter_key(k) for k in merged)
    out = write_hf_folder(tmp_path / "merged", family_by_name(cfg.family).hf_config_dict(cfg, "float32"),
                          native_to_hf(merged, cfg))
    assert _rel(_hf_logits(out), loong) <= TOL


def test_merge_lora_is_w_plus_scaled_b_a() -> None:
    from loong.llm.lora import merge_lora

    g = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(s, generator=g) for s in ((3, 10, 6), (3, 2, 6), (3, 10, 2)))
    stem = "decoder.layers.mlp.linear_fc1"
    full = {f"{stem}.weight": w, f"{stem}.lora_A.weight": a, f"{stem}.lora_B.weight": b, "x": torch.ones(1)}
    merged = merge_lora(full, LoraConfig(rank=2, alpha=4.0))
    assert set(merged) == {f"{stem}.weight", "x"}
    for i in range(3):
        torch.testing.assert_close(merged[f"{stem}.weight"][i], w[i] + 2.0 * b[i] @ a[i])
    with pytest.raises(LoongError, match="no matching"):
        merge_lora({f"{stem}.lora_A.weight": a, f"{stem}.weight": w}, LoraConfig(rank=2))
    with pytest.raises(LoongError, match="do not fit"):
        merge_lora({**full, f"{stem}.weight": w[:, :5]}, LoraConfig(rank=2))


def test_bad_lora_configs_fail_clearly(tiny_llama_hf: Path) -> None:
    from loong.llm.hf import model_config_from_hf
    from loong.llm.lora import apply_lora, check_lora_config

    with pytest.raises(LoongError, match="rank=-1"):
        check_lora_config(LoraConfig(rank=-1))
    with pytest.raises(LoongError, match="dropout"):
        check_lora_config(LoraConfig(rank=4, dropout=1.0))
    with pytest.raises(LoongError, match="sequence_parallel"):
        check_lora_config(LoraConfig(rank=4), sequence_parallel=True)
    with _world() as world:
        model = _model(world, model_config_from_hf(tiny_llama_hf))
        with pytest.raises(LoongError, match="match no layer.*linear_qkv"):
            apply_lora([model], LoraConfig(rank=4, targets=["q_proj"]))
        with pytest.raises(LoongError, match="RMSNorm"):
            apply_lora([model], LoraConfig(rank=4, targets=["final_layernorm"]))


# --- loong-llm train / convert, in-process --------------------------------------------------
def _cli(*argv: str) -> tuple[int, str]:
    from loong.llm.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(list(argv))
    sys.stderr.write(err.getvalue())
    return rc, err.getvalue()


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train_loss"] for r in records if "train_loss" in r}


@pytest.fixture(scope="module")
def runs(tiny_llama_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An 8-step LoRA run (checkpoints at 4 and 8, save_hf), and a run resumed from its step 4."""
    out = tmp_path_factory.mktemp("lora_runs")
    hf = f"model.init_from_hf={tiny_llama_hf}"
    rc, _ = _cli("train", hf, *LORA, *TRAIN, "train.save_hf=true", f"output_dir={out}", "run_name=a")
    assert rc == 0
    step4 = out / "a" / "checkpoints" / "step_00000004"
    rc, _ = _cli("train", *TRAIN, f"train.resume={step4}", f"output_dir={out}", "run_name=b")
    assert rc == 0
    return {"a": out / "a", "b": out / "b", "hf": tiny_llama_hf, "root": out}


def _plain(step_dir: Path) -> dict[str, torch.Tensor]:
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors

    with _world():
        return load_plain_tensors(str(step_dir))


@pytest.mark.slow
def test_training_moves_only_adapters_and_lowers_the_loss(runs: dict[str, Path]) -> None:
    from loong.core.checkpoint import read_config, resolve_checkpoint
    from loong.llm.hf_io import read_hf_folder
    from loong.llm.lora import is_adapter_key
    from loong.llm.models.hf_mapping import hf_to_native

    losses = _losses(runs["a"])
    assert sorted(losses) == list(range(1, 9))
    assert sum(losses[s] for s in (6, 7, 8)) / 3 < losses[1] - 0.03, losses
    step_dir = resolve_checkpoint(runs["a"])
    assert read_config(step_dir)["model"]["lora"]["rank"] == 8
    plain = _plain(step_dir)
    from loong.core.config import from_dict
    from loong.llm.schema import LLMRunConfig

    cfg = from_dict(LLMRunConfig, read_config(step_dir)).model
    for key, tensor in hf_to_native(read_hf_folder(runs["hf"])[1], cfg).items():
        assert torch.equal(plain[key], tensor), key  # frozen: bit-identical after 8 steps
    adapters = [k for k in plain if is_adapter_key(k) and not k.startswith("optimizer.")]
    assert len(adapters) == 8 and all(plain[k].abs().max() > 0 for k in adapters)
    # the optimiser holds state for the adapters only
    opt = {k.split(".", 3)[-1] for k in plain if k.startswith("optimizer.state.exp_avg.")}
    assert opt == set(adapters)


@pytest.mark.slow
def test_resumed_lora_run_continues_with_the_same_losses(runs: dict[str, Path]) -> None:
    a, b = _losses(runs["a"]), _losses(runs["b"])
    assert sorted(b) == [5, 6, 7, 8]
    for step in b:
        assert abs(a[step] - b[step]) <= 1e-6, (a, b)


@pytest.mark.slow
def test_convert_merge_lora_end_to_end(runs: dict[str, Path]) -> None:
    from loong.core.checkpoint import read_config, resolve_checkpoint
    from loong.core.config import from_dict
    from loong.core.engines.megatron.state import load_full_state
    from loong.llm.lora import apply_lora
    from loong.llm.schema import LLMRunConfig

    dst = runs["root"] / "converted"
    rc, err = _cli("convert", str(runs["a"]), str(dst))
    assert rc == 2 and "LoRA checkpoint" in err and "--merge-lora" in err and not dst.exists()
    rc, _ = _cli("convert", str(runs["a"]), str(dst), "--merge-lora")
    assert rc == 0
    # the same bytes as train.save_hf=true wrote at the end of the run
    assert (dst / "model.safetensors").read_bytes() == (runs["a"] / "hf" / "model.safetensors").read_bytes()
    # and the logits of the LoRA model at that checkpoint
    step_dir = resolve_checkpoint(runs["a"])
    cfg = from_dict(LLMRunConfig, read_config(step_dir)).model
    plain = _plain(step_dir)
    with _world() as world:
        model = _model(world, cfg)
        apply_lora([model], cfg.lora)
        load_full_state([model], plain)
        loong = _logits(model)
    assert _rel(_hf_logits(dst), loong) <= TOL


# --- TP=2 against TP=1, one 2-process launch ---------------------------------------------------
@pytest.fixture(scope="module")
def tp(tiny_llama_hf: Path, tmp_path_factory: pytest.TempPathFactory, run_workers) -> dict:  # noqa: ANN001
    out = tmp_path_factory.mktemp("lora_tp") / "result.json"
    run_workers(WORKER, str(tiny_llama_hf), str(out))
    return json.loads(out.read_text())


@pytest.mark.slow
def test_tp2_equals_tp1_loss_and_adapter_gradients(tp: dict) -> None:
    assert abs(tp["loss"]["tp2"] - tp["loss"]["tp1"]) / abs(tp["loss"]["tp1"]) <= TOL
    assert tp["grad_keys"]["tp1"] == tp["grad_keys"]["tp2"]
    assert len(tp["grad_keys"]["tp1"]) == 8 and all(".lora_" in k for k in tp["grad_keys"]["tp1"])
    assert tp["grad_min_norm"] > 0  # every adapter (A and B) really has a gradient
    assert tp["grad_err"] <= TOL
    assert tp["trainable_are_adapters"]


@pytest.mark.slow
def test_tp2_training_and_resume_at_tp1_track_tp1(tp: dict) -> None:
    ref = tp["tp1"]["losses"]
    for name in ("tp2", "tp1_resumed_from_tp2"):
        got = tp[name]["losses"]
        start = 2 if name.startswith("tp1_resumed") else 0
        assert got[:start] == [float("-inf")] * start
        assert max(abs(a - b) / abs(b) for a, b in zip(got[start:], ref[start:], strict=True)) <= TOL
    for name in ("tp1", "tp2", "tp1_resumed_from_tp2"):
        assert tp[name]["base_equal"] and tp[name]["adapters_moved"], name
