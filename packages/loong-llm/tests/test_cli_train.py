"""``loong-llm train`` end to end on CPU: what a run writes, that it learns, exact resume, safe saves,
SIGTERM handling and the Hugging Face export.

Runs are few and shared through module-scoped fixtures. One run directory (``r``) carries a story:
6 steps → resumed to 12 → a resumed run to 18 whose periodic save at step 15 fails → resumed again to
18. An uninterrupted 18-step run (``u``) is the reference every resumed step must reproduce. The LR
schedule is constant after a 2-step warm-up so that raising ``train.steps`` does not reshape it (a
cosine decay over ``train.steps`` legitimately changes when the total changes).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from loong.llm.cli import main

pytestmark = pytest.mark.slow

COMMON = ["train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2",
          "train.eval_interval=3", "train.eval_iters=1", "train.progress=false",
          "train.lr_decay_style=constant", "train.warmup_steps=2"]
SHORT = 6  # steps of the first run
RESUMED = 12  # steps after the first resume
FULL = 18  # steps of the uninterrupted reference and of the last resume


# --- helpers ---------------------------------------------------------------------------------
def _train(out: Path, run_name: str, *overrides: str, common: list[str] = COMMON) -> tuple[int, str]:
    """Run ``loong-llm train`` in-process; returns (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["train", *common, f"output_dir={out}", f"run_name={run_name}", *overrides])
    sys.stderr.write(err.getvalue())  # still visible in pytest's captured output on failure
    return rc, err.getvalue()


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _train_records(records: list[dict]) -> list[dict]:
    return [r for r in records if "train_loss" in r]


def _by_step(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


def _latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def _state(step_dir: Path) -> dict:
    return json.loads((step_dir / "trainer_state.json").read_text())


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _assert_same_training(got: list[dict], ref: list[dict]) -> None:
    """Per step: the same loss, gradient norm and learning rate (within 1e-6)."""
    ref_by_step = {r["step"]: r for r in ref}
    assert got, "no steps to compare"
    for r in got:
        e = ref_by_step[r["step"]]
        assert abs(r["train_loss"] - e["train_loss"]) <= 1e-6, (r["step"], r["train_loss"], e["train_loss"])
        assert abs(r["grad_norm"] - e["grad_norm"]) <= 1e-6 * max(1.0, e["grad_norm"]), r["step"]
        assert r["lr"] == pytest.approx(e["lr"], rel=1e-12, abs=0), r["step"]


# --- the runs --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli_train")


@pytest.fixture(scope="module")
def first_run(out: Path) -> dict:
    rc, err = _train(out, "r", f"train.steps={SHORT}")
    return {"rc": rc, "err": err, "run": out / "r", "records": _records(out / "r")}


@pytest.fixture(scope="module")
def resumed(first_run: dict) -> dict:
    run = first_run["run"]
    before = len(_records(run))
    rc, err = _train(run.parent, "r", f"train.steps={RESUMED}")
    records = _records(run)
    return {"rc": rc, "err": err, "run": run, "new": records[before:], "records": records}


@pytest.fixture(scope="module")
def failed_save(resumed: dict) -> dict:
    """Resume to 18 with a save every 3 steps; the engine's save fails half-way at step 15."""
    from loong.core.engines.megatron.engine import MegatronEngine

    run = resumed["run"]
    good = run / "checkpoints" / f"step_{RESUMED:08d}"
    before_files = _snapshot(good)
    attempts: list[Path] = []

    def broken_save(self, directory: Path) -> None:  # noqa: ANN001
        attempts.append(Path(directory))
        (Path(directory) / "__0_0.distcp").write_bytes(b"half a shard")
        raise RuntimeError("injected failure in the middle of a checkpoint save")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MegatronEngine, "save", broken_save)
        with pytest.raises(RuntimeError, match="injected failure"):
            _train(run.parent, "r", f"train.steps={FULL}", "train.save_interval=3")
    return {"run": run, "good": good, "before_files": before_files, "attempts": attempts,
            "latest": _latest(run), "records": _records(run)}


@pytest.fixture(scope="module")
def after_failure(failed_save: dict) -> dict:
    run = failed_save["run"]
    before = len(_records(run))
    rc, err = _train(run.parent, "r", f"train.steps={FULL}")
    return {"rc": rc, "err": err, "run": run, "new": _records(run)[before:]}


@pytest.fixture(scope="module")
def uninterrupted(out: Path) -> list[dict]:
    rc, _ = _train(out, "u", f"train.steps={FULL}")
    assert rc == 0
    return _records(out / "u")


@pytest.fixture(scope="module")
def long_run(out: Path) -> dict:
    """40 steps at seq 64 on the default schedule (cosine), exporting an HF folder at the end."""
    common = ["train.seq_length=64", "train.global_batch_size=4", "train.micro_batch_size=2",
              "train.eval_iters=1", "train.progress=false"]
    rc, err = _train(out, "long", "train.steps=40", "train.save_hf=true", common=common)
    return {"rc": rc, "err": err, "run": out / "long", "records": _records(out / "long")}


# --- a short run and what it writes ----------------------------------------------------------
def test_short_run_writes_checkpoint(first_run: dict) -> None:
    from transformers import AutoTokenizer

    assert first_run["rc"] == 0, first_run["err"][-3000:]
    ckpts = first_run["run"] / "checkpoints"
    assert _latest(first_run["run"]) == "step_00000006"
    step_dir = ckpts / "step_00000006"
    assert (step_dir / "config.yaml").is_file() and (step_dir / "trainer_state.json").is_file()
    assert any(step_dir.glob("*.distcp")), "no model/optimiser shards"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000006"]  # nothing half-written
    tok = AutoTokenizer.from_pretrained(step_dir / "tokenizer")
    assert len(tok) == 512 and tok.eos_token == "<|endoftext|>"
    assert "run directory:" in first_run["err"] and "loss " in first_run["err"]


def test_saved_config_is_the_resolved_config(first_run: dict) -> None:
    cfg = yaml.safe_load((first_run["run"] / "checkpoints" / "step_00000006" / "config.yaml").read_text())
    assert cfg["run_name"] == "r" and cfg["task"] == "llm.pretrain" and cfg["engine"] == "megatron"
    t = cfg["train"]
    assert (t["steps"], t["seq_length"], t["global_batch_size"], t["micro_batch_size"]) == (6, 32, 4, 2)
    assert t["lr_decay_style"] == "constant" and t["lr"] == 3e-3  # override and preset default both resolved
    m = cfg["model"]  # the tiny preset's values, not the schema defaults (2 layers x 64)
    assert (m["preset"], m["num_layers"], m["hidden_size"], m["ffn_hidden_size"]) == ("tiny", 4, 128, 384)
    assert (m["num_query_groups"], m["vocab_size"], m["tie_word_embeddings"]) == (2, 512, True)
    assert cfg["parallel"]["tp"] == 1 and cfg["data"]["path"] is None


def test_trainer_state(first_run: dict) -> None:
    state = _state(first_run["run"] / "checkpoints" / "step_00000006")
    last = _train_records(first_run["records"])[-1]
    assert state["step"] == 6 and state["consumed_samples"] == 6 * 4
    assert state["loss"] == last["train_loss"]
    assert state["scheduler"]["num_steps"] == 6
    assert state["layout"]["tp"] == 1 and state["layout"]["world_size"] == 1


def test_metrics_jsonl(first_run: dict) -> None:
    records = first_run["records"]
    train = _train_records(records)
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for r in train:
        assert math.isfinite(r["train_loss"]) and 4.0 < r["train_loss"] < 8.0  # ~ln(512)=6.24 at start
        assert r["lr"] > 0 and r["tokens_per_s"] > 0 and math.isfinite(r["grad_norm"])
    assert train[0]["lr"] < train[-1]["lr"] == pytest.approx(3e-3)  # warm-up, then constant
    evals = _by_step(records, "eval_loss")
    assert sorted(evals) == [3, 6] and all(math.isfinite(v) for v in evals.values())


def test_tensorboard_events(first_run: dict) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((first_run["run"] / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = EventAccumulator(str(files[0]))
    acc.Reload()
    train = {e.step: e.value for e in acc.Scalars("train/loss")}
    expected = _by_step(first_run["records"], "train_loss")
    assert sorted(train) == sorted(expected)
    assert all(abs(train[s] - expected[s]) <= 1e-5 for s in expected)
    assert sorted(e.step for e in acc.Scalars("eval/loss")) == [3, 6]


def test_loss_png(first_run: dict) -> None:
    from PIL import Image

    png = first_run["run"] / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as img:
        img.verify()
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size[0] > 200 and img.size[1] > 100


def test_loss_falls(long_run: dict) -> None:
    # measured: 6.23 -> 5.38 (mean of the last 5 steps), a 13.7% drop; random init sits at ln(512)=6.24
    assert long_run["rc"] == 0, long_run["err"][-3000:]
    losses = [r["train_loss"] for r in _train_records(long_run["records"])]
    assert len(losses) == 40
    drop = 1 - (sum(losses[-5:]) / 5) / losses[0]
    assert drop > 0.10, (drop, losses)
    final_eval = _by_step(long_run["records"], "eval_loss")[40]
    assert final_eval < 0.92 * losses[0], (final_eval, losses[0])


# --- resume --------------------------------------------------------------------------------
def test_resume_continues_from_saved_step(resumed: dict) -> None:
    assert resumed["rc"] == 0, resumed["err"][-3000:]
    assert "resumed from" in resumed["err"] and "step_00000006 at step 6" in resumed["err"]
    new_steps = [r["step"] for r in _train_records(resumed["new"])]
    assert new_steps[0] == 7 and new_steps == list(range(7, 13))
    # the file as a whole holds every step exactly once
    assert [r["step"] for r in _train_records(resumed["records"])] == list(range(1, 13))
    run = resumed["run"]
    assert _latest(run) == "step_00000012" and _state(run / "checkpoints" / "step_00000012")["step"] == 12
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000006", "step_00000012"]


def test_resume_equals_uninterrupted_run(first_run: dict, resumed: dict, uninterrupted: list[dict]) -> None:
    ref = _train_records(uninterrupted)
    assert [r["step"] for r in ref] == list(range(1, FULL + 1))
    _assert_same_training(_train_records(first_run["records"]), ref)  # steps 1-6: same seed, same data
    _assert_same_training(_train_records(resumed["new"]), ref)  # steps 7-12: after the resume
    ref_eval = _by_step(uninterrupted, "eval_loss")
    for step, value in _by_step(resumed["records"], "eval_loss").items():
        assert abs(value - ref_eval[step]) <= 1e-6, step


def test_failed_periodic_save_keeps_previous_checkpoint(failed_save: dict) -> None:
    from loong.core.checkpoint import resolve_checkpoint

    run, good = failed_save["run"], failed_save["good"]
    assert [p.name for p in failed_save["attempts"]] == [".step_00000015.tmp"]  # the periodic save
    assert failed_save["latest"] == "step_00000012"
    assert resolve_checkpoint(run) == good and _state(good)["step"] == 12
    assert _snapshot(good) == failed_save["before_files"]  # untouched, byte for byte
    stale = run / "checkpoints" / ".step_00000015.tmp"
    assert (stale / "__0_0.distcp").read_bytes() == b"half a shard"
    assert not (run / "checkpoints" / "step_00000015").exists()
    assert max(r["step"] for r in _train_records(failed_save["records"])) == 15  # it got that far


def test_resume_after_failed_save(after_failure: dict, uninterrupted: list[dict]) -> None:
    assert after_failure["rc"] == 0, after_failure["err"][-3000:]
    assert "step_00000012 at step 12" in after_failure["err"]
    new = _train_records(after_failure["new"])
    assert [r["step"] for r in new] == list(range(13, FULL + 1))
    _assert_same_training(new, _train_records(uninterrupted))
    ckpts = after_failure["run"] / "checkpoints"
    # the stale temporary directory is cleaned by the next successful save; keep_last=2 prunes step 6
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000012", "step_00000018"]
    assert _latest(after_failure["run"]) == "step_00000018"


def test_rerun_of_finished_run_says_so_and_writes_nothing(after_failure: dict) -> None:
    run = after_failure["run"]
    before = _snapshot(run)
    rc, err = _train(run.parent, "r", f"train.steps={RESUMED}")  # the run is past step 12 already
    assert rc == 0
    assert err.strip().splitlines() == [f"{run} is finished: its checkpoint step_00000018 is at step 18 of "
                                        "train.steps=12; nothing to train (raise train.steps to continue it, or "
                                        "train.resume=none for a new run)"]
    assert _snapshot(run) == before


# --- SIGTERM -------------------------------------------------------------------------------
def test_sigterm_saves_and_exits_cleanly(out: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOONG_SINGLE_PROCESS")}
    run = out / "sig"
    log = out / "sig.stderr"
    with log.open("w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "loong.llm.cli", "train", *COMMON, "train.steps=100000",
             f"output_dir={out}", "run_name=sig"],
            stdout=subprocess.DEVNULL, stderr=err_file, env=env,
        )
        try:
            deadline = time.monotonic() + 240  # start-up imports megatron; the machine may be busy
            while len(_train_records(_records(run))) < 2:
                assert proc.poll() is None, f"exited early ({proc.returncode}): {log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, "no training steps logged in time"
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stderr = log.read_text()
    assert rc == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    assert "signal received" in stderr and "interrupted: saved" in stderr
    last_step = _train_records(_records(run))[-1]["step"]
    assert 2 <= last_step < 100000
    assert _latest(run) == f"step_{last_step:08d}"
    step_dir = run / "checkpoints" / f"step_{last_step:08d}"
    assert _state(step_dir)["step"] == last_step
    assert str(step_dir) in stderr  # the message names the saved checkpoint
    assert "rerun the same command to continue" in stderr  # and how to resume


# --- Hugging Face export -------------------------------------------------------------------
def test_save_hf_loads_and_matches_convert(long_run: dict, out: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert long_run["rc"] == 0, long_run["err"][-3000:]
    hf_dir = long_run["run"] / "hf"
    assert (hf_dir / "config.json").is_file()
    converted = out / "long_converted"
    assert main(["convert", str(long_run["run"]), str(converted)]) == 0

    # both folders hold the same tensors, bit for bit
    a, b = load_file(hf_dir / "model.safetensors"), load_file(converted / "model.safetensors")
    assert set(a) == set(b) and "model.embed_tokens.weight" in a
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)

    tok = AutoTokenizer.from_pretrained(hf_dir)
    tok2 = AutoTokenizer.from_pretrained(converted)
    text = "def add(a, b):\n    return a + b"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == tok2(text, add_special_tokens=False)["input_ids"] and len(tok) == 512
    assert tok.decode(ids) == text

    m1 = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    m2 = AutoModelForCausalLM.from_pretrained(converted, attn_implementation="eager").eval()
    assert m1.config.num_hidden_layers == 4 and m1.config.hidden_size == 128
    x = torch.tensor([ids])
    with torch.no_grad():
        l1, l2 = m1(x).logits, m2(x).logits
    assert torch.equal(l1, l2)
    # the exported model is the trained one: its loss on text is far below a random model's ln(512)
    with torch.no_grad():
        loss = m1(x, labels=x).loss.item()
    assert loss < 0.92 * math.log(512), loss


def test_profile_steps_write_trace_and_table(out: Path) -> None:
    """``train.profile_steps=[2,3]`` profiles exactly those steps: a Perfetto trace with the steps'
    operators and an operator table; a malformed window is a clear error before training."""
    rc, err = _train(out, "profiled", "train.steps=4", "train.save_final=false", "train.eval_iters=0",
                     "train.profile_steps=[2,3]")
    assert rc == 0, err
    prof = out / "profiled" / "profile"
    trace = json.loads((prof / "trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("addmm" in n or "mm" == n.split("::")[-1] for n in names), sorted(names)[:20]
    assert "Self CPU" in (prof / "ops.txt").read_text()
    assert f"profile: {prof / 'trace.json'}" in err
    rc, err = _train(out, "bad_window", "train.steps=2", "train.profile_steps=[3,1]")
    assert rc != 0 and "train.profile_steps=[3, 1]" in err
