"""``loong-diffusion convert`` both ways, ``train.save_diffusers`` and the export of the weights' moving averages
(``train.ema_decay``, ``train.export_ema``): diffusers → Loong → diffusers gives back the folder's tensors and
``config.json`` bit for bit; a converted checkpoint starts the same run as ``model.init_from_diffusers``; a
checkpoint written as a diffusers folder predicts in diffusers what it predicts in Loong; the EMA export holds the
checkpoint's averages, not its weights; bad sources exit 2 and write nothing."""

from __future__ import annotations

import contextlib
import copy
import io
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from loong.core.checkpoint.inspect import checkpoint_tensors
from loong.diffusion.cli import main
from loong.diffusion.models.wan import WanTransformer, save_diffusers, to_diffusers, wan_preset
from loong.diffusion.models.wan.mapping import WEIGHTS_NAME

#: a few steps of small clips: what these tests need of a run is its checkpoint, not its learning
SMALL = ["train.progress=false", "train.eval_interval=0", "train.eval_iters=0", "data.frames=2", "data.height=8",
         "data.width=8", "train.global_batch_size=4", "train.micro_batch_size=4"]


def _main(*argv: str | Path) -> tuple[int, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue() + err.getvalue()


def _folder(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((path / "config.json").read_text()), load_file(path / WEIGHTS_NAME)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])] == []


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 steps with ``train.ema_decay=0.5``, exporting the averages through ``train.save_diffusers``."""
    out = tmp_path_factory.mktemp("ema_run")
    rc, log = _main("train", *SMALL, f"output_dir={out}", "run_name=ema", "train.steps=3", "train.ema_decay=0.5",
                    "train.export_ema=true", "train.save_diffusers=true")
    assert rc == 0, log
    assert "hf/ (diffusers)" in log
    return out / "ema"


@pytest.mark.parametrize("variant", ["t2v", "i2v", "ti2v"])
def test_diffusers_to_loong_to_diffusers_is_bit_exact(tmp_path: Path, wan_pair, variant: str) -> None:  # noqa: ANN001
    reference, _, config = wan_pair(variant)
    src = tmp_path / "pipeline" / "transformer"  # as a diffusers pipeline holds it: TI2V's flag is in model_index.json
    copy.deepcopy(reference).to(torch.bfloat16).save_pretrained(src)  # bf16: the dtype must survive too
    (src.parent / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline",
                                                             "expand_timesteps": config.expand_timesteps}))
    rc, log = _main("convert", src, tmp_path / "loong")
    assert rc == 0, log
    step_dir = tmp_path / "loong" / "checkpoints" / "step_00000000"
    assert f"wrote {step_dir}; train from it: loong-diffusion train train.resume={tmp_path / 'loong'}" in log
    model = yaml.safe_load((step_dir / "config.yaml").read_text())["model"]
    assert model["preset"] == {"t2v": "tiny", "i2v": "tiny_i2v", "ti2v": "tiny_ti2v"}[variant]
    assert all(model[k] is None for k in ("num_layers", "in_channels", "expand_timesteps"))  # the preset's own
    assert json.loads((step_dir / "trainer_state.json").read_text())["weights_only"] is True
    rc, log = _main("convert", tmp_path / "loong", tmp_path / "back")  # the run folder: its newest step
    assert rc == 0, log
    (want_config, want), (got_config, got) = _folder(src), _folder(tmp_path / "back")
    assert got_config == want_config
    assert next(iter(got.values())).dtype == torch.bfloat16
    _assert_same(got, want)


def test_convert_starts_the_same_run_as_init_from_diffusers(tmp_path: Path) -> None:
    torch.manual_seed(3)
    start = WanTransformer(wan_preset("tiny"))
    folder = save_diffusers(start.state_dict(), start.config, tmp_path / "start")
    assert _main("convert", folder, tmp_path / "converted")[0] == 0
    rc, log = _main("train", *SMALL, f"output_dir={tmp_path}", "run_name=a", "train.steps=2",
                    f"model.init_from_diffusers={folder}")
    assert rc == 0, log
    rc, log = _main("train", *SMALL, f"output_dir={tmp_path}", "run_name=b", "train.steps=2",
                    f"train.resume={tmp_path / 'converted'}")
    assert rc == 0, log
    assert "step_00000000 at step 0" in log
    a = checkpoint_tensors(tmp_path / "a" / "checkpoints" / "step_00000002")
    b = checkpoint_tensors(tmp_path / "b" / "checkpoints" / "step_00000002")
    _assert_same(b, a)  # weights and Adam's moments after the same two steps from the same start
    assert not torch.equal(a["model.wan.head.weight"], start.head.weight.detach())


def test_a_checkpoint_as_a_diffusers_folder_predicts_as_in_loong(tmp_path: Path, ema_run: Path, wan) -> None:  # noqa: ANN001
    from diffusers import WanTransformer3DModel

    from loong.diffusion.convert import load_model, read_checkpoint

    rc, log = _main("convert", ema_run / "checkpoints" / "step_00000003", tmp_path / "hf", "--dtype", "fp32")
    assert rc == 0 and f"wrote {tmp_path / 'hf'}" in log, log
    theirs = WanTransformer3DModel.from_pretrained(tmp_path / "hf").eval()
    ckpt = read_checkpoint(ema_run)
    ours = load_model(ckpt.state, ckpt.wan).eval()
    inputs = wan.wan_inputs(ckpt.wan)
    with torch.no_grad():
        error = wan.relative_error(ours(inputs["latents"], inputs["timestep"], inputs["text"]),
                                   wan.run_diffusers(theirs, inputs))
    assert error <= 1e-5, error


def test_the_ema_export_holds_the_averages(tmp_path: Path, ema_run: Path) -> None:
    saved = checkpoint_tensors(ema_run / "checkpoints" / "step_00000003")
    config = yaml.safe_load((ema_run / "checkpoints" / "step_00000003" / "config.yaml").read_text())["train"]
    assert config["save_hf"] is True and config["save_diffusers"] is True  # one export, two spellings
    averages = to_diffusers({k.removeprefix("ema.wan."): v for k, v in saved.items() if k.startswith("ema.wan.")})
    weights = to_diffusers({k.removeprefix("model.wan."): v for k, v in saved.items() if k.startswith("model.wan.")})
    _assert_same(_folder(ema_run / "hf")[1], {k: v.contiguous() for k, v in averages.items()})
    assert not torch.equal(averages["proj_out.weight"], weights["proj_out.weight"])
    for flags, want in (([], weights), (["--ema"], averages)):  # convert writes either, on request
        out = tmp_path / ("ema" if flags else "raw")
        rc, log = _main("convert", ema_run, out, *flags)
        assert rc == 0, log
        _assert_same(_folder(out)[1], {k: v.contiguous() for k, v in want.items()})


def test_bad_sources_exit_2_and_write_nothing(tmp_path: Path, ema_run: Path) -> None:
    (tmp_path / "empty").mkdir()
    cases = [
        ((tmp_path / "empty", tmp_path / "x"), "neither a diffusers transformer folder"),
        ((tmp_path / "missing", tmp_path / "x"), "does not exist"),
        ((ema_run / "hf", tmp_path / "x", "--ema"), "--ema exports a Loong checkpoint's moving averages"),
    ]
    pipeline = tmp_path / "pipeline"
    save_diffusers(WanTransformer(wan_preset("tiny")).state_dict(), wan_preset("tiny"), pipeline / "transformer")
    cases.append(((pipeline, tmp_path / "x"), "pass " + str(pipeline / "transformer")))
    rc, log = _main("train", *SMALL, f"output_dir={tmp_path}", "run_name=plain", "train.steps=1")
    assert rc == 0, log
    cases.append(((tmp_path / "plain", tmp_path / "x", "--ema"), "holds no moving averages of the weights (its run "
                                                                 "had train.ema_decay=0.0); drop --ema"))
    for argv, message in cases:
        rc, log = _main("convert", *argv)
        assert rc == 2 and message in log, (argv, log)
    assert not (tmp_path / "x").exists()


def test_both_a14b_experts_export_and_convert_as_a_pipelines_two_transformers(tmp_path: Path) -> None:
    rc, log = _main("train", *SMALL, "model=tiny_a14b", f"output_dir={tmp_path}", "run_name=pair", "train.steps=2",
                    "train.ema_decay=0.5", "train.export_ema=true", "train.save_diffusers=true")
    assert rc == 0, log
    saved = checkpoint_tensors(tmp_path / "pair" / "checkpoints" / "step_00000002")
    rc, log = _main("convert", tmp_path / "pair", tmp_path / "conv", "--ema")
    assert rc == 0, log
    for expert, folder in (("high_noise", "transformer"), ("low_noise", "transformer_2")):
        prefix = f"ema.{expert}.wan."
        want = to_diffusers({k.removeprefix(prefix): v for k, v in saved.items() if k.startswith(prefix)})
        want = {k: v.contiguous() for k, v in want.items()}
        _assert_same(_folder(tmp_path / "pair" / "hf" / folder)[1], want)  # train.save_diffusers: the averages
        _assert_same(_folder(tmp_path / "conv" / folder)[1], want)
    high, low = (_folder(tmp_path / "conv" / f)[1]["proj_out.weight"] for f in ("transformer", "transformer_2"))
    assert not torch.equal(high, low)  # two experts, each trained on its own steps
