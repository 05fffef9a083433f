"""Export and re-import end to end (CPU, tiny configs, offline): ``loong-embodied train ... train.save_lerobot=true``
of the tiny GR00T N1.7 writes ``<run>/lerobot/`` (with its base checkpoint inside) that lerobot 0.6.1's
``GrootPolicy.from_pretrained`` + ``make_pre_post_processors(pretrained_path=...)`` load with HF_HUB_OFFLINE=1 and
that gives Loong's loss on the same batch and draws; ``convert RUN DST`` writes the same; ``model.init_from=<that
folder>`` starts a run from exactly those weights; a folder of another policy or other sizes is refused (exit 2,
nothing written). Pi0.5's import (its tiny sizes need lerobot patched, so no CLI run can hold them) is
``load_initial_weights`` of a lerobot ``PI05Policy.save_pretrained`` folder inside ``pi05_testing``'s patches."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loong.embodied.cli import main
from loong.embodied.policies import POLICIES
from loong.embodied.policies.groot_n1_7 import lerobot as groot_mapping
from loong.embodied.task import load_initial_weights

sys.path.insert(0, str(Path(__file__).parent))  # the shared fixtures modules beside this file
import groot_testing as gt  # noqa: E402
import pi05_testing as pt  # noqa: E402

TOL = 1e-5
RUN_ARGS = ["model.policy=groot_n1_7", "model.preset=tiny", "data.synthetic_episodes=4"]


def _cli(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOONG_SINGLE_PROCESS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-m", "loong.embodied.cli", *argv], capture_output=True, text=True,
                          timeout=600, env=env, cwd=cwd)


def _main(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        rc = main(list(argv))
    return rc, err.getvalue()


def _run_dir(out: Path) -> Path:
    (run_dir,) = [p for p in out.iterdir() if not p.name.startswith(".")]
    return run_dir


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("export")
    # lerobot's preprocessor names nvidia/Cosmos-Reason2-2B's processor: the HF cache holds the tiny one (offline)
    env = gt.make_lerobot_env(root / "lerobot_env")
    out = root / "runs"
    proc = _cli(root, "train", *RUN_ARGS, "train.steps=3", "train.save_lerobot=true", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = _run_dir(out)
    return {"env": env, "root": root, "run_dir": run_dir, "lerobot": run_dir / "lerobot"}


def _raw_batch(processor, seed: int) -> dict:
    """A raw batch of the synthetic reach dataset's features (its cameras, 64x64; state, action chunk)."""
    g = torch.Generator().manual_seed(seed)
    b, chunk = 2, processor.config.chunk_size
    batch = {cam: torch.rand(b, 3, 64, 64, generator=g) for cam in processor.camera_keys}
    batch[processor.state_key] = torch.randn(b, processor.state_dim, generator=g)
    batch[processor.action_key] = torch.randn(b, chunk, processor.action_dim, generator=g)
    pad = torch.zeros(b, chunk, dtype=torch.bool)
    pad[0, -2:] = True
    batch["action_is_pad"] = pad
    batch["task"] = ["reach the red target", "reach the blue target"]
    return batch


def _assert_same_loss_in_lerobot(folder: Path, loaded) -> None:
    """lerobot loads ``folder`` (weights = the Loong policy's, all of them) and gives its loss on one batch."""
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.groot.modeling_groot import GrootPolicy

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    # the export names its groot_base/ relative to itself; lerobot resolves relative paths from the working directory
    with contextlib.chdir(folder):
        theirs = GrootPolicy.from_pretrained(".").eval()
    _, expected = groot_mapping.to_lerobot(loaded.config, loaded.policy.state_dict(), loaded.processor,
                                           base_model_path="unused")
    state = theirs.state_dict()
    assert set(state) == set(expected)
    for key, value in expected.items():  # from_pretrained only warns about weights it does not load
        assert torch.equal(state[key], value), key
    pre, _post = make_pre_post_processors(theirs.config, pretrained_path=str(folder))
    batch = _raw_batch(loaded.processor, seed=5)
    with torch.no_grad():
        torch.manual_seed(3)  # lerobot draws noise then time from the global generator; Loong the same way
        their_loss, _ = theirs.forward(pre(copy.deepcopy(batch)))
        torch.manual_seed(3)
        our_loss, _ = loaded.policy.eval().loss(loaded.processor(batch))
    rel = float((our_loss - their_loss).abs() / their_loss.abs().clamp_min(1e-12))
    assert rel <= TOL, (our_loss.item(), their_loss.item())


def test_save_lerobot_folder_loads_in_lerobot_offline_with_the_same_loss(exported: dict) -> None:
    from loong.embodied.inference import load_policy

    folder = exported["lerobot"]
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "policy_preprocessor.json", "policy_postprocessor.json",
            groot_mapping.EXPORT_BASE_DIR} <= names
    base = folder / groot_mapping.EXPORT_BASE_DIR
    assert (base / "config.json").is_file() and (base / "backbone" / "config.json").is_file()
    loaded = load_policy(exported["run_dir"], device="cpu", dtype="fp32")
    _assert_same_loss_in_lerobot(folder, loaded)


def test_convert_writes_the_same_loadable_folder(exported: dict) -> None:
    from loong.embodied.inference import load_policy

    dst = exported["root"] / "converted"
    rc, log = _main("convert", str(exported["run_dir"]), str(dst))
    assert rc == 0, log
    loaded = load_policy(exported["run_dir"], device="cpu", dtype="fp32")
    _assert_same_loss_in_lerobot(dst, loaded)


def test_convert_verify_passes_both_ways_and_fails_on_a_tampered_folder(exported: dict) -> None:
    """``convert --verify``: Loong -> lerobot and lerobot -> Loong reread both sides and match bit for bit; a
    tensor changed in the written model.safetensors fails the check (exit 2 for the CLI), naming it."""
    from safetensors.torch import load_file, save_file

    from loong.core.checkpoint.safetensors_io import VerifyError
    from loong.embodied.inference import load_policy
    from loong.embodied.lerobot_io import verify_export

    dst = exported["root"] / "verified"
    rc, log = _main("convert", str(exported["run_dir"]), str(dst), "--verify", "--no-progress")
    assert rc == 0, log
    file = load_file(str(dst / "model.safetensors"))
    assert f"verify: {len(file)} tensors, {sum(v.numel() for v in file.values()):,} parameters match bit for bit " \
           "(lerobot float32 / Loong float32)" in log, log
    rc, log = _main("convert", str(dst), str(exported["root"] / "back"), "--verify", "--no-progress")
    assert rc == 0, log
    assert "parameters match bit for bit (Loong float32 / lerobot float32)" in log, log
    name = sorted(file)[3]
    file[name] = file[name].clone()
    file[name].view(-1)[2] += 1
    save_file(file, str(dst / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_policy(exported["run_dir"], device="cpu", dtype="fp32")
    with pytest.raises(VerifyError, match=rf"verify: {name} differs between {dst / 'model.safetensors'} and "):
        verify_export(dst, loaded.name, loaded.config, loaded.policy.state_dict(), loaded.processor)


def _checkpoint_dtypes(ckpt: Path) -> dict[str, torch.dtype]:
    """The saved dtype of every model tensor of a Loong checkpoint (from its DCP metadata)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from loong.core.checkpoint import resolve_checkpoint

    meta = dcp.FileSystemReader(str(resolve_checkpoint(ckpt))).read_metadata().state_dict_metadata
    return {k: v.properties.dtype for k, v in meta.items() if isinstance(v, TensorStorageMetadata)}


def test_convert_dtype_both_ways_with_verify(exported: dict) -> None:
    """``--dtype bf16`` (Loong -> lerobot) writes bf16 floats, ids as they are, and ``--verify`` compares after the
    cast; lerobot -> Loong, ``--dtype auto`` keeps the folder's bf16 and ``--dtype fp32`` sets fp32 (as in
    loong-llm and loong-vlm convert)."""
    from safetensors.torch import load_file

    root = exported["root"]
    rc, log = _main("convert", str(exported["run_dir"]), str(root / "bf16"), "--dtype", "bf16", "--verify",
                    "--no-progress")
    assert rc == 0 and "match bit for bit (lerobot bfloat16 / Loong float32)" in log, log
    file = load_file(str(root / "bf16" / "model.safetensors"))
    fp32 = load_file(str(exported["lerobot"] / "model.safetensors"))  # the run's own export, of the same weights
    assert set(file) == set(fp32)
    for key, tensor in fp32.items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert file[key].dtype == want.dtype and torch.equal(file[key], want), key
    rc, log = _main("convert", str(root / "bf16"), str(root / "back16"), "--verify", "--no-progress")
    assert rc == 0 and "match bit for bit (Loong bfloat16 / lerobot bfloat16)" in log, log
    saved = _checkpoint_dtypes(root / "back16")
    assert saved and {d for d in saved.values() if d.is_floating_point} == {torch.bfloat16}, saved
    rc, log = _main("convert", str(root / "bf16"), str(root / "back32"), "--dtype", "fp32", "--verify",
                    "--no-progress")
    assert rc == 0 and "match bit for bit (Loong float32 / lerobot bfloat16)" in log, log
    assert {d for d in _checkpoint_dtypes(root / "back32").values() if d.is_floating_point} == {torch.float32}


def test_convert_verify_exits_2_naming_a_tensor_the_writer_changed(exported: dict,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A conversion whose written tensors differ from the source (the writer perturbs one element) fails
    ``convert --verify`` with exit code 2 and one ``error:`` line naming the tensor, both ways."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from loong.embodied import lerobot_io

    root = exported["root"]
    exported_file = load_file(str(exported["lerobot"] / "model.safetensors"))
    name = sorted(k for k, v in exported_file.items() if v.is_floating_point())[3]
    real_write, real_dcp_save = lerobot_io.write_safetensors, dcp.save

    def corrupting_write(path: Path, entries: dict, get: object, **kwargs: object) -> int:
        def bad(key: str) -> torch.Tensor:
            tensor = get(key)  # type: ignore[operator]
            if key == name:
                tensor = tensor.clone()
                tensor.view(-1)[1] += 1
            return tensor

        return real_write(path, entries, bad, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(lerobot_io, "write_safetensors", corrupting_write)
        rc, log = _main("convert", str(exported["run_dir"]), str(root / "tampered"), "--verify", "--no-progress")
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1, log
    assert errors[0].startswith(f"error: verify: {name} differs between {root / 'tampered' / 'model.safetensors'} "
                                "and the checkpoint: 1 of ") and "first at" in errors[0], errors

    changed: list[str] = []

    def corrupting_dcp_save(state: dict, *args: object, **kwargs: object) -> object:
        model = dict(state["model"])
        changed.append(sorted(k for k, v in model.items() if v.is_floating_point())[0])
        bad = model[changed[0]].clone()
        bad.view(-1)[0] += 1
        return real_dcp_save({**state, "model": {**model, changed[0]: bad}}, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(dcp, "save", corrupting_dcp_save)
        rc, log = _main("convert", str(exported["lerobot"]), str(root / "tampered_back"), "--verify",
                        "--no-progress")
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and len(changed) == 1, log
    assert errors[0].startswith(f"error: verify: {changed[0]} differs between {root / 'tampered_back' / 'checkpoints'}"
                                ) and f"and {exported['lerobot']}: 1 of " in errors[0], errors


def test_convert_streams_one_tensor_at_a_time_both_ways(exported: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loong -> lerobot reads one checkpoint tensor per read and writes it before the next is read (the base
    checkpoint inside the export and model.safetensors alike; a converter that loads the policy first reads them
    all before the first write); lerobot -> Loong reads the folder's tensors one at a time, each once, never the
    file whole."""
    from loong.core.checkpoint import safetensors_io
    from loong.embodied import lerobot_io

    events: list[tuple[str, str]] = []
    read, write = lerobot_io.CheckpointWeights.__getitem__, safetensors_io.write_safetensors

    def logged_read(self: lerobot_io.CheckpointWeights, key: str) -> torch.Tensor:
        events.append(("read", key))
        return read(self, key)

    def logged_write(path: Path, entries: dict, get: object, **kwargs: object) -> int:
        def logged_get(name: str) -> torch.Tensor:
            tensor = get(name)  # type: ignore[operator]
            events.append(("write", name))
            return tensor

        return write(path, entries, logged_get, **kwargs)

    root = exported["root"]
    with monkeypatch.context() as m:
        m.setattr(lerobot_io.CheckpointWeights, "__getitem__", logged_read)
        m.setattr(lerobot_io, "write_safetensors", logged_write)
        m.setattr(groot_mapping, "write_safetensors", logged_write)
        rc, log = _main("convert", str(exported["run_dir"]), str(root / "streamed"), "--no-progress")
    assert rc == 0, log
    spec = POLICIES.get("groot_n1_7")
    with torch.device("meta"):
        keys = list(spec.policy_class(spec.presets["tiny"]).state_dict())
    reads = [k for kind, k in events if kind == "read"]
    # each tensor once for groot_base/ and once for model.safetensors (the embedding for the LM head lerobot
    # derives from it: the tied embedding itself stays out of the file)
    assert sorted(reads) == sorted(keys * 2)
    assert len([k for kind, k in events if kind == "write"]) == 2 * len(keys)
    assert not [(a, b) for a, b in zip(events, events[1:], strict=False) if a[0] == b[0] == "read"]

    def whole(self: safetensors_io.SafetensorsFolder) -> dict[str, torch.Tensor]:
        raise AssertionError("the lerobot folder was loaded whole")

    folder_reads: list[str] = []
    get = safetensors_io.SafetensorsFolder.get
    with monkeypatch.context() as m:
        m.setattr(safetensors_io.SafetensorsFolder, "load_all", whole)
        m.setattr(safetensors_io.SafetensorsFolder, "get", lambda self, key: folder_reads.append(key) or get(self, key))
        rc, log = _main("convert", str(root / "streamed"), str(root / "streamed_back"), "--no-progress")
    assert rc == 0, log
    in_file = safetensors_io.SafetensorsFolder(root / "streamed").keys()
    assert sorted(folder_reads) == sorted(in_file)  # the tied embedding is the file's LM head, read once


def test_convert_draws_progress_bars_unless_told_not_to(exported: dict) -> None:
    """Both directions and their --verify draw a progress bar on stderr (the converters' shared one:
    safetensors_io.progress_bar), ending at 100% at the last tensor; --no-progress draws none."""
    root = exported["root"]
    rc, log = _main("convert", str(exported["run_dir"]), str(root / "bars"), "--verify")
    assert rc == 0, log
    done = [line for line in log.splitlines() if " 100% " in line]
    # groot_base/'s weights, then model.safetensors (its last tensor: the LM head lerobot derives), then verify
    assert [line.split()[0] for line in done] == ["convert", "convert", "verify"], log
    assert f" 100% {groot_mapping.LM_HEAD} " in done[1], done
    rc, log = _main("convert", str(root / "bars"), str(root / "bars_back"), "--verify")
    assert rc == 0, log
    assert [line.split()[0] for line in log.splitlines() if " 100% " in line] == ["convert", "verify"], log
    rc, log = _main("convert", str(root / "bars"), str(root / "bars_quiet"), "--verify", "--no-progress")
    assert rc == 0 and "verify: " in log and " 100% " not in log and "━" not in log, log


def test_init_from_the_export_starts_from_its_weights(exported: dict) -> None:
    """A run from the lerobot folder at lr 0: its checkpoint holds exactly the exported weights (API and CLI)."""
    from loong.embodied.inference import load_policy

    folder = exported["lerobot"]
    spec = POLICIES.get("groot_n1_7")
    trained = load_policy(exported["run_dir"], device="cpu", dtype="fp32").policy.state_dict()
    torch.manual_seed(99)
    fresh = spec.policy_class(spec.presets["tiny"])
    load_initial_weights(fresh, folder, spec, spec.presets["tiny"])
    assert set(fresh.state_dict()) == set(trained)
    assert all(torch.equal(v, trained[k]) for k, v in fresh.state_dict().items())
    out = exported["root"] / "init_runs"
    proc = _cli(exported["root"], "train", *RUN_ARGS, "train.steps=1", "train.lr=0", "train.min_lr=0",
                f"model.init_from={folder}", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    step0 = load_policy(_run_dir(out), device="cpu", dtype="fp32").policy.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in step0.items())


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.policy=pi05", "model.preset=tiny"], "a lerobot groot_n1_7 policy, not model.policy=pi05"),
    ([*RUN_ARGS, "model.config.hidden_size=48"], "do not fit model.policy=groot_n1_7"),
])
def test_init_from_a_folder_of_another_policy_or_size_is_refused(exported: dict, tmp_path: Path,
                                                                 overrides: list[str], message: str) -> None:
    out = tmp_path / "out"
    rc, log = _main("train", *overrides, f"model.init_from={exported['lerobot']}", f"output_dir={out}")
    assert rc == 2 and message in log and "model.init_from=" in log, log
    assert not out.exists()


def test_pi05_init_from_a_lerobot_folder_is_bit_exact(tmp_path: Path) -> None:
    """lerobot's PI05Policy (shrunk by the test-only patches) saved with save_pretrained; a Loong Pi0.5 of the
    same sizes loads it through load_initial_weights (model.init_from's path) bit for bit; other sizes refuse."""
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    from loong.core.errors import LoongError
    from loong.embodied.policies.pi05 import lerobot as pi05_mapping

    spec = POLICIES.get("pi05")
    with pt.lerobot_patches(tmp_path / "hub"):
        torch.manual_seed(5)
        theirs = PI05Policy(pt.lerobot_config())
        src = tmp_path / "pi05_lerobot"
        theirs.save_pretrained(src)
        reloaded = PI05Policy.from_pretrained(str(src)).state_dict()
        config = pt.parity_config()
        ours = spec.policy_class(config)
        load_initial_weights(ours, src, spec, config)
        for key, value in ours.state_dict().items():
            assert torch.equal(value, reloaded[pi05_mapping.to_lerobot_name(key)]), key
        with pytest.raises(LoongError, match="do not fit model.policy=pi05"):
            other = config.replace(expert_width=config.expert_width * 2)
            load_initial_weights(spec.policy_class(other), src, spec, other)
