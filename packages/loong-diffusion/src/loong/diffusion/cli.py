"""``loong-diffusion``: train Wan video diffusion transformers (flow matching) on the fsdp engine."""

from __future__ import annotations

import argparse
import sys

from loong.core.cli import Command, add_convert_options, make_cli, run_train

CONFIG_MODULE = "loong.diffusion.configs"
CONFIG_NAME = "train"
#: the local model folders that sample and preprocess take (nothing is downloaded)
VAE_HELP = "a diffusers AutoencoderKLWan folder (or a diffusers Wan pipeline folder with vae/)"
TEXT_ENCODER_HELP = ("a UMT5 encoder + tokenizer: a diffusers Wan pipeline folder (text_encoder/, tokenizer/) or one "
                     "folder holding both")


def _presets_epilog() -> str:
    from loong.core.config import config_groups

    # only this package's presets: config_groups also lists other plugins' groups of the same name
    from loong.diffusion.models.wan.config import PRESETS

    lines = ["config groups (choose with GROUP=OPTION):"]
    for group, options in config_groups(CONFIG_MODULE).items():
        if group == "model":
            options = [o for o in options if o in PRESETS]
        lines.append(f"  {group}: {', '.join(options)}")
    lines += [
        "",
        "any key can be overridden with dotted KEY=VALUE, e.g.:",
        "  loong-diffusion train train.steps=50 data.frames=8 train.timestep_sampling=logit_normal",
        "  loong-diffusion train model=tiny model.num_layers=4 model.recompute=selective",
        "keys: model.{preset,<any WanConfig field>,recompute,init_from_diffusers},",
        "  data.{num_clips,num_classes,frames,height,width,text_len,text_drop_prob,seed} (latent units),",
        "  data.sizes=[[F,H,W],...] (mixed latent sizes), data.pack_tokens=N (packing: N video tokens a micro-batch),",
        "  data.source=shards data.path=DIR (the output of loong-diffusion preprocess; then data.text_len=512),",
        "  train.{steps,global_batch_size,micro_batch_size,lr,...,timestep_sampling,logit_mean,logit_std,",
        "  timestep_shift}, parallel.{fsdp,cp_ulysses,cp_ring}, output_dir, run_name,",
        "  train.ema_decay=0.999 (EMA of the weights), train.save_diffusers=true (+ train.export_ema=true: the EMA),",
        "  train.preview_interval=N (a GIF every N steps; train.preview_steps, train.preview_guidance)",
    ]
    return "\n".join(lines)


def _setup_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides")


def _run_train(args: argparse.Namespace) -> int:
    from loong.diffusion.schema import DiffusionRunConfig

    return run_train(CONFIG_MODULE, CONFIG_NAME, args.overrides, DiffusionRunConfig, export_label="hf/ (diffusers)")


def _setup_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a diffusers WanTransformer3DModel folder, or a Loong checkpoint (run, checkpoints or "
                               "step dir)")
    p.add_argument("dst", help="output folder")
    p.add_argument("--ema", action="store_true",
                   help="write the checkpoint's moving averages of the weights (train.ema_decay) instead of the "
                        "weights (Loong -> diffusers)")

    add_convert_options(p, dtype_help="dtype of the written weights (auto: as saved)", shard_default="10GiB",
                        shard_help="largest safetensors shard written (Loong -> diffusers), e.g. 10GiB, 500MB "
                                   "(default: 10GiB, diffusers' own); more than one shard comes with "
                                   "diffusion_pytorch_model.safetensors.index.json")

def _run_convert(args: argparse.Namespace) -> int:
    from loong.core.checkpoint.safetensors_io import parse_size
    from loong.diffusion.convert import convert

    out, summary = convert(args.src, args.dst, dtype=args.dtype, ema=args.ema,
                           max_shard_bytes=parse_size(args.max_shard_size), progress=not args.no_progress,
                           check=args.verify)
    hint = f"; train from it: loong-diffusion train train.resume={args.dst}" if out.name.startswith("step_") else ""
    print(f"wrote {out}{hint}", file=sys.stderr)
    if summary is not None:
        print(summary, file=sys.stderr)
    return 0


def _setup_sample(p: argparse.ArgumentParser) -> None:
    from loong.diffusion.sampling import SCHEDULERS

    p.add_argument("ckpt", metavar="CKPT", help="a Loong checkpoint (run, checkpoints or step dir; a folder: its "
                                                "newest) or a diffusers WanTransformer3DModel folder")
    p.add_argument("--prompt", default=None, help="the text (needs --text-encoder and --vae)")
    p.add_argument("--negative-prompt", default="", help="the guidance's negative text (default: empty)")
    p.add_argument("--class", dest="label", type=int, default=None, metavar="N",
                   help="a synthetic run's condition: class N (default: every class, side by side)")
    p.add_argument("--vae", default=None, metavar="DIR",
                   help=VAE_HELP + ": decode to pixels; without it the latents are shown as colours")
    p.add_argument("--text-encoder", default=None, metavar="DIR", help=TEXT_ENCODER_HELP)
    p.add_argument("--steps", type=int, default=20, help="denoising steps (default: %(default)s)")
    p.add_argument("--guidance", type=float, default=5.0,
                   help="classifier-free guidance scale; <= 1: none (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the starting noise (default: %(default)s)")
    p.add_argument("--shift", type=float, default=None,
                   help="the scheduler's timestep shift (default: the run's train.timestep_shift, else 5)")
    p.add_argument("--scheduler", choices=SCHEDULERS, default="unipc",
                   help="diffusers' UniPC multistep (Wan's default) or flow-matching Euler (default: %(default)s)")
    p.add_argument("--frames", type=int, default=None, help="pixel frames, 4k + 1 (with --vae; default: the run's)")
    p.add_argument("--height", type=int, default=None, help="pixels (with --vae; default: the run's)")
    p.add_argument("--width", type=int, default=None, help="pixels (with --vae; default: the run's)")
    p.add_argument("--text-len", type=int, default=None,
                   help="tokens the prompt is padded to (default: a shards run's data.text_len, else 512)")
    p.add_argument("--output", "-o", default=None, metavar="FILE.gif",
                   help="the GIF (default: <run>/samples/step_N_<condition>_seed<S>.gif)")
    p.add_argument("--fps", type=float, default=8.0, help="GIF frames per second (default: %(default)s)")
    p.add_argument("--ema", action="store_true",
                   help="use the checkpoint's moving averages of the weights (train.ema_decay)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="compute dtype (auto: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_sample(args: argparse.Namespace) -> int:
    from loong.diffusion.generate import sample

    s = sample(args.ckpt, output=args.output, prompt=args.prompt, negative_prompt=args.negative_prompt,
               label=args.label, vae=args.vae, text_encoder=args.text_encoder, steps=args.steps,
               guidance=args.guidance, seed=args.seed, shift=args.shift, scheduler=args.scheduler,
               frames=args.frames, height=args.height, width=args.width, text_len=args.text_len, fps=args.fps,
               ema=args.ema, device=args.device, dtype=args.dtype, progress=not args.no_progress)
    kind = "pixels" if s["pixels"] else "latents shown as colours"
    at = f" of step {s['step']}" if s["step"] is not None else ""
    print(f"wrote {s['output']}: {s['clips']} clip(s) x {s['frames']} frames of {s['height']}x{s['width']} ({kind}), "
          f"{s['condition']}, {s['steps']} {s['scheduler']} steps, guidance {s['guidance']}, shift {s['shift']}, "
          f"seed {s['seed']}{', EMA weights' if s['ema'] else ''}{at}, {s['seconds']} s", file=sys.stderr)
    return 0


def _setup_preprocess(p: argparse.ArgumentParser) -> None:
    from loong.diffusion.preprocess.buckets import DEFAULT_BUCKETS

    p.add_argument("manifest", help='JSONL, one sample a line: {"video": PATH, "caption": TEXT} or {"image": PATH, '
                                    '"caption": TEXT}, paths relative to the manifest')
    p.add_argument("--output", "-o", required=True, metavar="DIR",
                   help="folder of shards (for data.path); rerunning into it continues where it stopped")
    p.add_argument("--vae", required=True, metavar="DIR", help=VAE_HELP)
    p.add_argument("--text-encoder", required=True, metavar="DIR", help=TEXT_ENCODER_HELP)
    p.add_argument("--buckets", default=DEFAULT_BUCKETS, metavar="FxHxW,...",
                   help="clip shapes in pixels, frames 4k+1 (1: images); each clip goes to the bucket of the nearest "
                        "aspect ratio it can fill without upscaling (default: %(default)s)")
    p.add_argument("--fps", type=float, default=None,
                   help="read videos at this frame rate (default: each video's own; Wan trains at 16)")
    p.add_argument("--text-len", type=int, default=512, help="tokens a caption is truncated to (Wan: 512)")
    p.add_argument("--shard-size", type=int, default=64, help="clips per shard (the unit of resuming)")
    p.add_argument("--on-error", default="fail", choices=["fail", "skip"],
                   help="a bad row (file:line) stops the run (fail) or is counted, reported and skipped (skip)")
    p.add_argument("--condition", default="none", choices=["none", "first", "first_last"],
                   help="also store each clip's image-to-video condition latent (the VAE latent of its first frame, "
                        "first_last: and its last, with empty frames between), for Wan I2V (first) and FLF2V "
                        "(first_last) training")
    p.add_argument("--image-encoder", default=None, metavar="DIR",
                   help="also store CLIP image features of the conditioning frames (Wan 2.1 I2V / FLF2V): a diffusers "
                        "Wan I2V pipeline folder (image_encoder/, image_processor/) or a CLIPVisionModel folder with "
                        "its preprocessor_config.json; needs --condition")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="the encoders' compute dtype")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_preprocess(args: argparse.Namespace) -> int:
    from loong.diffusion.preprocess import preprocess

    s = preprocess(args.manifest, args.output, vae=args.vae, text_encoder=args.text_encoder, buckets=args.buckets,
                   fps=args.fps, text_len=args.text_len, shard_size=args.shard_size, on_error=args.on_error,
                   device=args.device, dtype=args.dtype, condition=args.condition, image_encoder=args.image_encoder,
                   progress=not args.no_progress)
    resumed = f" (continued after line {s['resumed_at']})" if s["resumed_at"] else ""
    lines = [f"wrote {s['output']}/: {s['shards']} shards, index.json{resumed}",
             f"clips: {s['clips']} ({s['videos']} videos, {s['images']} images; {s['new_clips']} new)",
             "buckets: " + ", ".join(f"{name}: {n}" for name, n in s["buckets"].items()),
             f"skipped: {s['skipped']}"]
    lines += [f"  {row['where']}: {row['reason']}" for row in s["skipped_rows"][:20]]
    if s["skipped"] > 20:
        lines.append(f"  ... and {s['skipped'] - 20} more (listed in the shards' .json sidecars)")
    lines.append(f"seconds: {s['seconds']} ({s['clips_per_s']} clips/s)")
    image_len = f" data.image_len={s['image']['tokens']}" if s["image"] else ""
    lines.append(f"train on it: loong-diffusion train data.source=shards data.path={s['output']} "
                 f"data.text_len={args.text_len}{image_len}")
    print("\n".join(lines), file=sys.stderr)
    return 0


main = make_cli(
    prog="loong-diffusion",
    description="Train Wan 2.1 / 2.2 video diffusion transformers (flow matching) on the fsdp engine, on CPU or GPUs.",
    module="loong.diffusion.cli",
    commands={
        "train": Command("train a model (default: the tiny Wan on synthetic moving shapes, on CPU)",
                         _setup_train, _run_train),
        "convert": Command("convert a diffusers WanTransformer3DModel folder to a Loong checkpoint, or back "
                           "(direction from SRC)", _setup_convert, _run_convert),
        "sample": Command("generate a clip from a checkpoint and write a GIF preview (a synthetic run: its classes, "
                          "latents as colours; with --vae/--text-encoder: a prompt, pixels)", _setup_sample,
                          _run_sample),
        "preprocess": Command("encode videos / images + captions (JSONL) into latent shards for data.source=shards",
                              _setup_preprocess, _run_preprocess),
    },
    epilog=_presets_epilog,
)

if __name__ == "__main__":
    sys.exit(main())
