"""One trainer for all (issue 24): every modality's tiny embedded default goes through the same safety checks.

Each of loong-llm, loong-vlm, loong-diffusion and loong-embodied runs its own default (``<cli> train`` with nothing
but cheap overrides: 8 steps, a batch of 2 in 2 micro-batches, a checkpoint every 2 steps) through the one trainer
in loong-core, and must show the same behaviour (docs/checkpoints.md):

- **SIGKILL, SIGTERM, rerun: bit for bit.** The CLI, as a real process, is SIGKILLed once it has logged step 3
  (the kill lands in step 4 or its checkpoint write); the identical command, run again, resumes and is sent SIGTERM
  once it has logged step 5: it saves a checkpoint at the step boundary and exits 0; the identical command once
  more trains to the end. Every loss any attempt logged equals the uninterrupted run's loss of that step exactly,
  and the final checkpoints (model and optimiser state) are equal tensor for tensor (``torch.equal``).
- **A corrupted newest checkpoint** (one bit flipped in a shard) is skipped with its reason printed, and the
  previous checkpoint loads and continues bit for bit.
- **NaN**: a batch made NaN (every floating tensor of global batch 2) is handled as ``train.on_nonfinite`` says:
  ``stop`` exits non-zero naming step 3 and leaves the step-2 checkpoint intact, ``skip`` drops the update and
  counts it, ``rollback`` reloads step 2 and skips the batch from then on.
- **``loong env``** (and the modality's own ``env``) lists the modality's package with its installed version.

One process start per modality (the SIGKILLed run; it runs while the uninterrupted reference trains in-process);
everything else runs in-process.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the sibling helper module (pytest runs with --import-mode=importlib)
from trainer_faults import (  # noqa: E402
    logged_losses,
    metrics,
    nan_batch_task,
    run_in_process,
    sigkill_after_step,
    sigterm_after_step,
    start_cli,
)

from loong.core.checkpoint import read_config, read_state, verify_checkpoint  # noqa: E402
from loong.core.checkpoint.inspect import checkpoint_tensors  # noqa: E402

pytestmark = pytest.mark.slow

MODALITIES = ["loong-llm", "loong-vlm", "loong-diffusion", "loong-embodied"]
STEPS, SAVE_EVERY, KILL_AFTER, TERM_AFTER = 8, 2, 3, 5
#: cheap, and the same meaning in every modality; a constant LR after warm-up, so that a run continued past
#: train.steps (the corrupted-checkpoint check) trains its steps with the LR the reference had
COMMON = [f"train.steps={STEPS}", "train.global_batch_size=2", "train.micro_batch_size=1",
          f"train.save_interval={SAVE_EVERY}", "train.log_interval=1", "train.eval_interval=0", "train.eval_iters=0",
          "train.lr_decay_style=constant", "train.warmup_steps=2", "train.progress=false", "train.keep_last=0"]
#: the modality's own knobs that make its default cheaper still (same model, same data)
EXTRA = {"loong-llm": ["train.seq_length=32"], "loong-embodied": ["data.synthetic_episodes=20"]}


def _cli(modality: str) -> str:
    return f"loong.{modality.removeprefix('loong-')}.cli"


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


@dataclass
class Runs:
    """What the shared runs of one modality left behind, for the checks below."""

    modality: str
    out: Path
    reference: Path
    chain: Path
    logs: dict[str, str] = field(default_factory=dict)
    codes: dict[str, int] = field(default_factory=dict)

    def argv(self, run_name: str, *extra: str, out: Path | None = None) -> list[str]:
        """The modality's ``train`` command for ``<out>/<run_name>`` (``out``: the chain's output_dir by default)."""
        return ["train", *COMMON, *EXTRA.get(self.modality, []), f"output_dir={out or self.out}",
                f"run_name={run_name}", *extra]


@pytest.fixture(scope="module", params=MODALITIES)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """The uninterrupted reference, and the chain SIGKILL → rerun + SIGTERM → rerun to the end (same command)."""
    modality = request.param
    out = tmp_path_factory.mktemp(modality)
    # the reference has an output_dir of its own: nothing the chain's attempts do (or a rerun's new-run note) can see it
    r = Runs(modality, out, out / "reference" / "ref", out / "chain")
    cli = _cli(modality)
    log = out / "killed.log"
    # the one process start; it trains (and is watched, to be killed in time) while the reference trains here
    killed = start_cli(cli, r.argv("chain"), log)
    failure: list[BaseException] = []

    def kill() -> None:
        try:
            sigkill_after_step(killed, r.chain, KILL_AFTER, log)
        except BaseException as exc:  # re-raised below, in the test's thread
            failure.append(exc)

    killer = threading.Thread(target=kill)
    killer.start()
    try:
        r.codes["reference"], r.logs["reference"] = run_in_process(cli, r.argv("ref", out=out / "reference"))
    finally:
        killer.join()
    if failure:
        raise failure[0]
    assert r.codes["reference"] == 0, r.logs["reference"][-3000:]
    r.logs["killed"] = log.read_text()
    r.logs["killed_losses"] = json.dumps(logged_losses(r.chain))
    r.logs["killed_checkpoints"] = json.dumps(sorted(p.name for p in (r.chain / "checkpoints").iterdir()))
    r.codes["term"], r.logs["term"] = sigterm_after_step(cli, r.argv("chain"), r.chain, TERM_AFTER)
    r.codes["finish"], r.logs["finish"] = run_in_process(cli, r.argv("chain"))
    return r


def _resumed_step(log: str) -> int:
    lines = [line for line in log.splitlines() if line.startswith("resumed from ")]
    assert len(lines) == 1, log[-3000:]
    return int(lines[0].rsplit(" ", 1)[1])


def test_sigkill_and_sigterm_then_the_same_command_continues_bit_for_bit(runs: Runs) -> None:
    reference = logged_losses(runs.reference)
    assert [s for s, _ in reference] == list(range(1, STEPS + 1))
    want = dict(reference)
    # the killed attempt stopped mid-run: it had logged KILL_AFTER, not the end, and left complete checkpoints only
    killed = json.loads(runs.logs["killed_losses"])
    assert KILL_AFTER <= max(s for s, _ in killed) < STEPS
    left = json.loads(runs.logs["killed_checkpoints"])
    assert _step(runs.chain, SAVE_EVERY).name in left and _step(runs.chain, STEPS).name not in left, left
    # the rerun resumed from the newest complete checkpoint of the killed attempt, then stopped on SIGTERM
    term = runs.logs["term"]
    resumed = _resumed_step(term)
    assert resumed in (SAVE_EVERY, 2 * SAVE_EVERY) and resumed <= max(s for s, _ in killed), term[-3000:]
    assert f"resumed from {_step(runs.chain, resumed)} at step {resumed}" in term
    stopped = [line for line in term.splitlines() if line.startswith("stopping at step ")]
    assert len(stopped) == 1 and stopped[0].endswith(": signal received"), term[-3000:]
    stop_step = int(stopped[0].split()[3].rstrip(":"))
    assert TERM_AFTER <= stop_step < STEPS, term[-3000:]
    # SIGTERM: a checkpoint at the step boundary it stopped at, and the documented clean exit
    assert runs.codes["term"] == 0, term[-3000:]
    verify_checkpoint(_step(runs.chain, stop_step))
    assert read_state(_step(runs.chain, stop_step))["step"] == stop_step
    # the third attempt continues from there to the end
    finish = runs.logs["finish"]
    assert runs.codes["finish"] == 0, finish[-3000:]
    assert f"resumed from {_step(runs.chain, stop_step)} at step {stop_step}" in finish, finish[-3000:]
    # every loss any attempt logged is the uninterrupted run's loss of that step, exactly
    chain = logged_losses(runs.chain)
    assert {s for s, _ in chain} == set(want)
    differ = [(s, loss, want[s]) for s, loss in chain if loss != want[s]]
    assert not differ, f"{runs.modality}: (step, resumed loss, uninterrupted loss) {differ}"
    got, ref = checkpoint_tensors(_step(runs.chain, STEPS)), checkpoint_tensors(_step(runs.reference, STEPS))
    assert sorted(got) == sorted(ref)
    assert any("exp_avg" in k for k in got), sorted(got)[:20]  # Adam's moments are compared too
    assert [k for k in got if not torch.equal(got[k], ref[k])] == []


def test_a_corrupted_newest_checkpoint_is_skipped_with_its_reason(runs: Runs) -> None:
    run = runs.out / "corrupt"
    shutil.copytree(runs.reference, run)
    newest = _step(run, STEPS)
    shard = max((p for p in newest.rglob("*.distcp")), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, the same size: only the checksum sees it
    shard.write_bytes(bytes(data))
    rc, log = run_in_process(_cli(runs.modality), runs.argv("corrupt", f"train.steps={STEPS + 1}"))
    assert rc == 0, log[-3000:]
    assert f"skipping checkpoint {newest.name}: " in log and "corrupted (SHA-256 differs" in log, log[-3000:]
    previous = STEPS - SAVE_EVERY
    assert f"resumed from {_step(run, previous)} at step {previous}" in log, log[-3000:]
    want = dict(logged_losses(runs.reference))
    again = logged_losses(run)[STEPS:]  # the lines this attempt added
    assert [s for s, _ in again] == list(range(previous + 1, STEPS + 2))
    assert [loss for s, loss in again if s <= STEPS] == [want[s] for s in range(previous + 1, STEPS + 1)]


@pytest.mark.parametrize("policy", ["stop", "skip", "rollback"])
def test_a_nan_batch_follows_train_on_nonfinite(runs: Runs, policy: str) -> None:
    task = nan_batch_task(read_config(_step(runs.reference, STEPS))["task"], batch=2)
    run = runs.out / f"nan-{policy}"
    rc, log = run_in_process(_cli(runs.modality), runs.argv(run.name, f"task={task}", "train.steps=4",
                                                            f"train.on_nonfinite={policy}"))
    diagnostic = "step 3 (global batch 2): the loss term 'loss' is NaN/Inf"
    if policy == "stop":
        assert rc != 0 and diagnostic in log and "stopped (train.on_nonfinite=stop)" in log, log[-3000:]
        verify_checkpoint(_step(run, 2))  # the last checkpoint is intact, nothing after it was written
        assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [_step(run, 2).name]
        return
    assert rc == 0, log[-3000:]
    state = read_state(_step(run, 4))
    assert state["nonfinite_steps"] == 1
    records = metrics(run)
    if policy == "skip":
        assert f"skipped {diagnostic}" in log, log[-3000:]
        assert [r["nonfinite_skipped"] for r in records if "nonfinite_skipped" in r] == [1]
        assert state["data"]["skipped_batches"] == []
    else:
        assert diagnostic in log and "rolled back to step_00000002 and skipping global batch 2" in log, log[-3000:]
        assert [(r["step"], r["rollback_to"], r["skipped_batch"]) for r in records if "rollback_to" in r] == [(3, 2, 2)]
        assert state["data"] == {"next_batch": 5, "skipped_batches": [2]}
    # steps 1-2 are the reference's (the NaN batch was not drawn yet); what was applied is finite
    assert logged_losses(run)[:2] == logged_losses(runs.reference)[:2]
    tensors = checkpoint_tensors(_step(run, 4))
    assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())


def test_loong_env_lists_the_modality(runs: Runs) -> None:
    version = importlib.metadata.version(runs.modality)
    for cli, argv in (("loong.core.cli", ["env", "--json"]), (_cli(runs.modality), ["env", "--json"])):
        rc, out = run_in_process(cli, argv)
        assert rc == 0, out[-3000:]
        listed = json.loads(out[out.index("{"):])["loong"]
        assert listed.get(runs.modality, "").split()[0] == version, (cli, listed)
