"""``loong-diffusion sample``, ``train.preview_interval`` and ``train.save_diffusers`` through ``WanPipeline``.

A tiny trained run (its synthetic classes): ``sample`` writes a readable GIF of the right frames and size; the
training preview is what ``sample`` draws from the same weights with the same settings, and a preview drawn under
Ulysses=2 on two gloo processes (the parameters sharded over both) is the one-process preview. With the tiny VAE and
UMT5 folders (``tiny_components.py``): the exported diffusers folder predicts as the Loong model, a ``WanPipeline``
built from it generates 2 denoising steps of the right shape, and ``sample --prompt`` gives that pipeline's frames
(the same noise) as pixels in a GIF. Bad input exits 2 and writes nothing.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from loong.diffusion.cli import main

#: the run: 20 steps of the default synthetic set (8 classes of 4 x 16 x 16 latents), previews at steps 10 and 20
STEPS = 20
RUN = ["train.progress=false", "train.eval_interval=0", "train.eval_iters=0", f"train.steps={STEPS}",
       "train.preview_interval=10", "train.preview_steps=3", "train.preview_guidance=2.0"]
#: the pixel clip of the pipeline tests: 5 frames of 32 x 32 (2 x 4 x 4 latents, 8 tokens)
PIXELS = {"frames": 5, "height": 32, "width": 32}
PROMPT = "a red ball rolls across a green field"


def _main(*argv: str | Path) -> tuple[int, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue() + err.getvalue()


def _gif(path: Path) -> np.ndarray:
    """The GIF's frames as RGB, ``[frames, height, width, 3]`` uint8."""
    from PIL import Image

    with Image.open(path) as im:
        frames = []
        for i in range(im.n_frames):
            im.seek(i)
            frames.append(np.asarray(im.convert("RGB")))
    return np.stack(frames)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sample_run")
    rc, log = _main("train", *RUN, f"output_dir={out}", "run_name=run", "train.save_diffusers=true")
    assert rc == 0, log
    return out / "run"


@pytest.fixture(scope="module")
def components(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tiny_components import tiny_text_encoder_folder, tiny_vae_folder

    root = tmp_path_factory.mktemp("components")
    return tiny_vae_folder(root / "vae"), tiny_text_encoder_folder(root / "text")


def test_sample_writes_a_gif_of_every_class_or_of_one(run: Path, tmp_path: Path) -> None:
    rc, log = _main("sample", run, "--steps", "3", "--no-progress")
    assert rc == 0, log
    path = run / "samples" / f"step_{STEPS:08d}_classes_seed0.gif"
    assert f"wrote {path}: 8 clip(s) x 4 frames of 16x16 (latents shown as colours), classes 0..7" in log
    frames = _gif(path)
    # 8 clips of 16 x 16 latents, each scaled x8 to 128 pixels, in a 3 x 3 grid with 2-pixel gaps
    assert frames.shape == (4, 3 * 128 + 4, 3 * 128 + 4, 3)
    assert frames[0, :128, :128].std() > 5  # a picture, not a flat colour
    rc, log = _main("sample", run, "--class", "2", "--steps", "3", "--output", tmp_path / "two.gif", "--no-progress")
    assert rc == 0 and "class 2" in log, log
    assert _gif(tmp_path / "two.gif").shape == (4, 128, 128, 3)


def test_the_training_preview_is_the_sample_of_its_weights(run: Path, tmp_path: Path) -> None:
    assert sorted(p.name for p in (run / "previews").iterdir()) == ["step_00000010.gif", "step_00000020.gif"]
    # the preview's settings: train.seed (1234), train.preview_steps, train.preview_guidance, UniPC, the run's shift
    rc, log = _main("sample", run, "--seed", "1234", "--steps", "3", "--guidance", "2", "--scheduler", "unipc",
                    "--output", tmp_path / "same.gif", "--no-progress")
    assert rc == 0, log
    preview, sampled = _gif(run / "previews" / f"step_{STEPS:08d}.gif"), _gif(tmp_path / "same.gif")
    assert preview.shape == sampled.shape == (4, 388, 388, 3)
    assert np.array_equal(preview, sampled)
    assert not np.array_equal(preview, _gif(run / "previews" / "step_00000010.gif"))  # other weights, other picture


@pytest.mark.slow
def test_a_preview_under_ulysses_2_is_the_one_process_preview(tmp_path: Path) -> None:
    short = ["train.progress=false", "train.eval_interval=0", "train.eval_iters=0", "train.steps=2",
             "train.preview_interval=2", "train.preview_steps=2", "train.save_final=false"]
    rc, log = _main("train", *short, f"output_dir={tmp_path}", "run_name=one")
    assert rc == 0, log
    # a fresh process: an in-process run leaves its distributed environment behind, which the workers would inherit
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "LOONG_SINGLE_PROCESS")}
    proc = subprocess.run([sys.executable, "-m", "loong.diffusion.cli", "train", "--nproc-per-node", "2", *short,
                           "parallel.cp_ulysses=2", f"output_dir={tmp_path}", "run_name=cp2"],
                          capture_output=True, text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"},
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, cp2 = (_gif(tmp_path / r / "previews" / "step_00000002.gif").astype(float) for r in ("one", "cp2"))
    assert one.shape == cp2.shape == (4, 388, 388, 3)
    # the weights agree to ~1e-7 (fp32, other reduction orders); colours then differ at most where a value sits on
    # a rounding edge, or where the GIF palette picked another nearby colour
    assert np.abs(one - cp2).mean() < 0.5 and np.abs(one - cp2).max() <= 16, np.abs(one - cp2).max()


@pytest.mark.parametrize("layout", ["parallel.fsdp=full", "parallel.fsdp=none"])
def test_a_bf16_run_previews_under_autocast(tmp_path: Path, layout: str) -> None:
    """bf16 on FSDP2 (bf16 parameters gathered) and on DDP (fp32 parameters): the preview predicts under autocast."""
    rc, log = _main("train", "train.precision=bf16", layout, "train.progress=false", "train.eval_interval=0",
                    "train.eval_iters=0", "train.steps=2", "train.preview_interval=2", "train.preview_steps=2",
                    "train.save_final=false", f"output_dir={tmp_path}", "run_name=bf16")
    assert rc == 0, log
    frames = _gif(tmp_path / "bf16" / "previews" / "step_00000002.gif")
    assert frames.shape == (4, 388, 388, 3) and frames[:, :128, :128].std() > 5


def _pipeline(hf: Path, components: tuple[Path, Path], shift: float):  # noqa: ANN202
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    vae, text = components
    return WanPipeline(tokenizer=AutoTokenizer.from_pretrained(text / "tokenizer"),
                       text_encoder=UMT5EncoderModel.from_pretrained(text / "text_encoder").eval(),
                       vae=AutoencoderKLWan.from_pretrained(vae).eval(),
                       scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                         num_train_timesteps=1000, flow_shift=shift),
                       transformer=WanTransformer3DModel.from_pretrained(hf).eval())


def test_the_exported_folder_generates_through_wan_pipeline_as_sample_does(run: Path, components: tuple[Path, Path],
                                                                           wan) -> None:  # noqa: ANN001
    from loong.diffusion.convert import load_model, read_checkpoint
    from loong.diffusion.generate import sample

    pipe = _pipeline(run / "hf", components, shift=3.0)
    ckpt = read_checkpoint(run)
    ours = load_model(ckpt.state, ckpt.wan).eval()
    inputs = wan.wan_inputs(ckpt.wan)
    with torch.no_grad():  # train.save_diffusers wrote the run's weights
        error = wan.relative_error(ours(inputs["latents"], inputs["timestep"], inputs["text"]),
                                   wan.run_diffusers(pipe.transformer, inputs))
    assert error <= 1e-5, error
    noise = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(7))  # sample's noise for seed 7
    theirs = pipe(PROMPT, negative_prompt="", **{"num_frames": 5, "height": 32, "width": 32}, num_inference_steps=2,
                  guidance_scale=3.0, latents=noise, output_type="np").frames
    assert theirs.shape == (1, 5, 32, 32, 3)
    vae, text = components
    got = sample(run, prompt=PROMPT, vae=vae, text_encoder=text, steps=2, guidance=3.0, seed=7, shift=3.0,
                 **PIXELS, output=run / "pixels.gif", progress=False)
    assert got["pixels"] and tuple(got["pictures"].shape) == (1, 5, 32, 32, 3)
    np.testing.assert_allclose(got["pictures"].numpy(), theirs, rtol=0, atol=1e-4)
    assert np.abs(theirs - theirs.mean()).max() > 0.01  # decoded pixels, not a constant
    assert _gif(run / "pixels.gif").shape == (5, 128, 128, 3)


def test_sample_from_the_cli_with_a_vae_writes_pixel_frames(run: Path, components: tuple[Path, Path],
                                                            tmp_path: Path) -> None:
    vae, text = components
    rc, log = _main("sample", run / "hf", "--prompt", PROMPT, "--vae", vae, "--text-encoder", text, "--steps", "2",
                    "--frames", "9", "--height", "32", "--width", "48", "--output", tmp_path / "p.gif",
                    "--no-progress")
    assert rc == 0, log
    assert "1 clip(s) x 9 frames of 32x48 (pixels), prompt 'a red ball rolls across a green field'" in log
    assert _gif(tmp_path / "p.gif").shape == (9, 128, 192, 3)


def test_bad_input_exits_2_and_writes_nothing(run: Path, components: tuple[Path, Path], tmp_path: Path) -> None:
    vae, text = components
    out = ["--output", tmp_path / "x.gif"]
    cases = [
        ((run, "--prompt", "a cat", *out), "--prompt needs --text-encoder DIR and --vae DIR"),
        ((run, "--class", "8", *out), "--class 8: this run's synthetic set has classes 0..7"),
        ((run, "--output", tmp_path / "x.png"), "the preview is a GIF"),
        ((run, "--vae", vae, *out), "--vae and --text-encoder go together"),
        ((run, "--height", "64", *out), "--frames/--height/--width are pixel sizes, for --vae"),
        ((run, "--ema", *out), "holds no moving averages of the weights"),
        ((run / "hf", *out), "is a diffusers folder: its conditions come from a text encoder"),
        ((run, "--prompt", "a cat", "--vae", vae, "--text-encoder", text, "--frames", "6", *out),
         "the VAE takes 4k + 1 frames"),
        ((run, "--steps", "0", *out), "--steps must be >= 1"),
    ]
    for argv, message in cases:
        rc, log = _main("sample", *argv, "--no-progress")
        assert rc == 2 and message in log, (argv, log)
    assert not any(tmp_path.iterdir())


def test_a_run_on_shards_previews_its_captions_and_samples_prompts(tmp_path: Path,
                                                                   components: tuple[Path, Path]) -> None:
    from preprocess_testing import write_manifest, write_video

    from loong.diffusion.preprocess import preprocess

    vae, text = components
    rows = [{"video": write_video(tmp_path / f"v{i}.mp4", 6, 32, 32, seed=i).name, "caption": f"a red ball {i}"}
            for i in range(3)]
    shards = tmp_path / "shards"
    preprocess(write_manifest(tmp_path / "m.jsonl", rows), shards, vae=vae, text_encoder=text, buckets="5x32x32",
               progress=False)
    rc, log = _main("train", "data.source=shards", f"data.path={shards}", "data.text_len=16", "train.steps=2",
                    "train.global_batch_size=2", "train.micro_batch_size=2", "train.progress=false",
                    "train.eval_interval=0", "train.eval_iters=0", "train.preview_interval=2", "train.preview_steps=2",
                    f"output_dir={tmp_path}", "run_name=real")
    assert rc == 0, log
    # the bucket's three clips (2 x 4 x 4 latents, x32 to 128 pixels) in a 2 x 2 grid, two latent frames
    assert _gif(tmp_path / "real" / "previews" / "step_00000002.gif").shape == (2, 258, 258, 3)
    rc, log = _main("sample", tmp_path / "real", "--prompt", "a red ball", "--vae", vae, "--text-encoder", text,
                    "--steps", "2", *("--frames", "5", "--height", "32", "--width", "32"), "--no-progress")
    assert rc == 0, log
    assert "1 clip(s) x 5 frames of 32x32 (pixels)" in log
    rc, log = _main("sample", tmp_path / "real", "--no-progress")
    assert rc == 2 and "trained on data.source=shards: its conditions are real text features" in log
