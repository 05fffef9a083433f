"""``loong-diffusion sample CKPT``: generate a clip from a Loong checkpoint (or a diffusers transformer folder) and
write a GIF preview.

Two kinds of condition:

- ``vae`` + ``text_encoder`` (local folders, as ``preprocess`` takes them): the prompt (and the negative prompt, for
  guidance) is encoded by UMT5 as ``WanPipeline`` encodes it, zero-padded to ``text_len`` tokens, and the denoised
  latents are decoded to pixels by the VAE. Sizes are pixels (``frames`` = 4k + 1).
- neither (the synthetic runs: their text features are made up per class, and their latents are no VAE's): the
  condition is the run's synthetic class text (``label``; default every class, side by side), the negative one
  zeros (what ``data.text_drop_prob`` trained), and the preview shows the latents as colours (:mod:`.preview`).
  The size is the run's latent size.

The denoising loop, schedulers and guidance are :mod:`.sampling`'s; the weights are read as ``convert`` reads them
(``ema``: the moving averages of the weights, ``train.ema_decay``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import torch

from loong.core.errors import LoongError
from loong.diffusion.convert import is_diffusers_folder, load_model, read_checkpoint
from loong.diffusion.data.synthetic import MovingShapes
from loong.diffusion.devices import cli_device
from loong.diffusion.flow import NUM_TRAIN_TIMESTEPS
from loong.diffusion.models.wan import WanConfig, load_diffusers
from loong.diffusion.preview import latent_colours, tile, write_gif
from loong.diffusion.sampling import ModelPredict, decode, denoise, flow_scheduler, pad_text

#: Wan's sampling shift for a model that comes without a run config (its T2V default; 480p often uses 3)
DEFAULT_SHIFT = 5.0
#: Wan's default clip in pixels (frames, height, width) when neither a run config nor the caller gives one
DEFAULT_PIXELS = (81, 480, 832)
#: UMT5's padded prompt length in Wan (``WanPipeline``'s ``max_sequence_length``)
WAN_TEXT_LEN = 512
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "prompt"


def _synthetic(config: dict[str, Any], wan: WanConfig) -> MovingShapes:
    d = config.get("data", {})
    return MovingShapes(num_clips=d.get("num_clips", 64), num_classes=d.get("num_classes", 8),
                        channels=wan.out_channels, frames=d.get("frames", 4), height=d.get("height", 16),
                        width=d.get("width", 16), text_len=d.get("text_len", 8), text_dim=wan.text_dim,
                        seed=d.get("seed", 0), sizes=d.get("sizes"))


def _check_size(latent: tuple[int, int, int], wan: WanConfig, what: str) -> None:
    if any(n < 1 or n % p for n, p in zip(latent, wan.patch_size, strict=True)):
        raise LoongError(f"{what} gives latents of {latent[0]} x {latent[1]} x {latent[2]} (frames x height x "
                         f"width), which must divide by the model's patch size {list(wan.patch_size)}")


def sample(source: str | Path, *, output: str | Path | None = None, prompt: str | None = None,
           negative_prompt: str = "", label: int | None = None, vae: str | Path | None = None,
           text_encoder: str | Path | None = None, steps: int = 20, guidance: float = 5.0, seed: int = 0,
           shift: float | None = None, scheduler: str = "unipc", frames: int | None = None,
           height: int | None = None, width: int | None = None, text_len: int | None = None, fps: float = 8.0,
           ema: bool = False, device: str = "auto", dtype: str = "auto", progress: bool = True) -> dict[str, Any]:
    """Generate from ``source`` (a Loong checkpoint — run, ``checkpoints`` or step folder — or a diffusers
    ``WanTransformer3DModel`` folder) and write a GIF; returns what was written and how (see the module docstring),
    ``pictures`` the frames themselves, ``[clips, frames, height, width, 3]`` in [0, 1] before the GIF's palette.

    ``shift``: the scheduler's (default: the run's ``train.timestep_shift``, or :data:`DEFAULT_SHIFT`);
    ``frames``/``height``/``width``: pixels, with a VAE; ``text_len``: the prompt's padded length (default: a run
    on shards' ``data.text_len``, else 512); ``dtype``: ``auto`` (bf16 on CUDA, fp32 on the CPU), ``fp32``, ``bf16``.
    Bad input raises :class:`LoongError` before anything is written (what the arguments alone decide: before
    anything is loaded).
    """
    started = time.perf_counter()
    source = Path(source)
    if (vae is None) != (text_encoder is None):
        raise LoongError("--vae and --text-encoder go together: the prompt is encoded and the latents decoded "
                         "(give both, or neither for a synthetic run's class conditions)")
    encoded = vae is not None
    if prompt is not None and not encoded:
        raise LoongError("--prompt needs --text-encoder DIR and --vae DIR (a UMT5 encoder + tokenizer and an "
                         "AutoencoderKLWan); a synthetic run's conditions are its classes: --class N")
    if encoded and label is not None:
        raise LoongError("--class picks a synthetic run's condition; with --text-encoder give --prompt")
    if encoded and prompt is None:
        raise LoongError("--text-encoder encodes --prompt TEXT: give the prompt")
    if output is not None and Path(output).suffix.lower() != ".gif":
        raise LoongError(f"--output {output}: the preview is a GIF (name it .gif)")
    if not encoded and any(v is not None for v in (frames, height, width)):
        raise LoongError("--frames/--height/--width are pixel sizes, for --vae; without a VAE the sample has the "
                         "run's latent size (data.frames x data.height x data.width)")
    if dtype not in ("auto", *DTYPES):
        raise LoongError(f"--dtype: {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    dev = cli_device(device)
    torch_dtype = DTYPES[dtype] if dtype != "auto" else (torch.bfloat16 if dev.type == "cuda" else torch.float32)

    # --- the model and what its run says --------------------------------------------------------
    config: dict[str, Any] = {}
    step = None
    if is_diffusers_folder(source):
        if ema:
            raise LoongError(f"--ema uses a Loong checkpoint's moving averages; {source} is a diffusers folder")
        if not encoded:
            raise LoongError(f"{source} is a diffusers folder: its conditions come from a text encoder; give "
                             "--prompt, --text-encoder DIR and --vae DIR")
        model = load_diffusers(source, dtype=torch_dtype, device=dev)
        wan, predict = model.config, ModelPredict(model.eval(), torch_dtype)
        default_output = Path("sample")
    else:
        ckpt = read_checkpoint(source, ema=ema)
        config, wan, step = ckpt.config, ckpt.wan, ckpt.step
        models = {e: load_model(state, wan, dtype=torch_dtype, device=dev).eval() for e, state in ckpt.states.items()}
        if len(models) == 1:
            predict = ModelPredict(models[""], torch_dtype)
        else:  # both A14B experts: switched at the boundary timestep, as WanPipeline switches them
            predict = ModelPredict(models["high_noise"], torch_dtype, models["low_noise"],
                                   wan.boundary_ratio * NUM_TRAIN_TIMESTEPS)
        default_output = ckpt.step_dir.parent.parent / "samples" / f"step_{step:08d}"
    if wan.image_dim is not None or wan.in_channels != wan.out_channels:
        raise LoongError(f"sample generates text-to-video; this model takes image conditioning (in_channels="
                         f"{wan.in_channels}, out_channels={wan.out_channels}, image_dim={wan.image_dim})")
    data = config.get("data", {})
    shift = shift if shift is not None else float(config.get("train", {}).get("timestep_shift", DEFAULT_SHIFT))
    sched = flow_scheduler(scheduler, shift)  # checks --shift and --scheduler before the encoders load

    # --- conditions and the latent size -----------------------------------------------------------
    if encoded:
        from loong.diffusion.preprocess.encode import Encoders

        assert prompt is not None  # checked above
        length = text_len or (data.get("text_len") if data.get("source") == "shards" else None) or WAN_TEXT_LEN
        enc = Encoders(vae, text_encoder, device=str(dev), dtype="bf16" if torch_dtype == torch.bfloat16 else "fp32",
                       text_len=length)
        if enc.text_dim != wan.text_dim or enc.latent_channels != wan.out_channels:
            raise LoongError(f"the encoders do not fit the model: the text encoder gives {enc.text_dim}-wide "
                             f"features and the VAE {enc.latent_channels} latent channels; the model takes text_dim="
                             f"{wan.text_dim} and {wan.out_channels} channels")
        text = pad_text(enc.encode_text(prompt), length)[None]
        negative = pad_text(enc.encode_text(negative_prompt), length)[None]
        if frames is None and height is None and width is None and data and data.get("source") != "shards":
            f, h, w = (data.get("sizes") or [[data.get("frames", 4), data.get("height", 16), data.get("width", 16)]])[0]
            frames, height, width = (f - 1) * enc.temporal + 1, h * enc.spatial, w * enc.spatial
        frames, height, width = (v if v is not None else d for v, d in zip((frames, height, width), DEFAULT_PIXELS,
                                                                          strict=True))
        if frames < 1 or (frames - 1) % enc.temporal or height % enc.spatial or width % enc.spatial:
            raise LoongError(f"--frames {frames} --height {height} --width {width}: the VAE takes {enc.temporal}k + 1 "
                             f"frames and sides that divide by {enc.spatial}")
        latent = ((frames - 1) // enc.temporal + 1, height // enc.spatial, width // enc.spatial)
        _check_size(latent, wan, f"--frames {frames} --height {height} --width {width}")
        what, name = f"prompt {prompt!r}", _slug(prompt)
    else:
        if data.get("source", "synthetic") != "synthetic":
            raise LoongError(f"{source} trained on data.source={data.get('source')}: its conditions are real text "
                             "features; give --prompt, --text-encoder DIR and --vae DIR")
        shapes = _synthetic(config, wan)
        if label is not None and not 0 <= label < shapes.num_classes:
            raise LoongError(f"--class {label}: this run's synthetic set has classes 0..{shapes.num_classes - 1} "
                             f"(data.num_classes={shapes.num_classes})")
        labels = [label] if label is not None else list(range(shapes.num_classes))
        text = torch.stack([shapes.text(c) for c in labels])
        negative = torch.zeros_like(text)  # the condition text dropout trained (data.text_drop_prob)
        latent = shapes.sizes[0]
        _check_size(latent, wan, "the run's data.frames/height/width")
        what = f"class {label}" if label is not None else f"classes 0..{shapes.num_classes - 1}"
        name = f"class{label}" if label is not None else "classes"

    # --- denoise, then pixels or colours ----------------------------------------------------------
    g = torch.Generator().manual_seed(seed)  # on the host: the same noise on every device
    noise = torch.randn(text.shape[0], wan.out_channels, *latent, generator=g).to(dev)
    tokens = None
    if wan.expand_timesteps:
        tokens = (latent[0] // wan.patch_size[0]) * (latent[1] // wan.patch_size[1]) * (latent[2] // wan.patch_size[2])
    latents = denoise(predict, noise, text.to(dev), negative.to(dev), scheduler=sched,
                      steps=steps, guidance=guidance, tokens=tokens, progress=progress)
    pictures = decode(enc.vae, latents) if encoded else latent_colours(latents)
    path = Path(output) if output is not None else Path(f"{default_output}_{name}_seed{seed}.gif")
    write_gif(tile(pictures), path, fps=fps)
    return {"output": path, "frames": pictures.shape[1], "height": pictures.shape[2], "width": pictures.shape[3],
            "clips": pictures.shape[0], "condition": what, "steps": steps, "guidance": guidance, "shift": shift,
            "scheduler": scheduler, "seed": seed, "step": step, "pixels": encoded, "ema": ema,
            "seconds": round(time.perf_counter() - started, 2), "pictures": pictures}


__all__ = ["DEFAULT_PIXELS", "DEFAULT_SHIFT", "WAN_TEXT_LEN", "sample"]
