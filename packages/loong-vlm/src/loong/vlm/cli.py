"""``loong-vlm``: train vision-language models (Qwen2.5-VL, Qwen3-VL, InternVL 3.5) on the megatron engine."""

from __future__ import annotations

import argparse
import sys

from loong.core.cli import HF_SHARDS_HELP, Command, add_convert_options, make_cli, run_train

CONFIG_MODULE = "loong.vlm.configs"
CONFIG_NAME = "train"
#: this package's own config groups (the search path may also hold other plugins' groups of the same name)
GROUPS = ("model", "encoder", "projector", "foundation")


def _presets_epilog() -> str:
    from importlib import resources

    from loong.core.config import config_groups

    lines = ["config groups (choose with GROUP=OPTION):"]
    for group, options in config_groups(CONFIG_MODULE).items():
        if group not in GROUPS:
            continue
        own = {p.stem for p in resources.files(CONFIG_MODULE).joinpath(group).iterdir() if p.name.endswith(".yaml")}
        lines.append(f"  {group}: {', '.join(o for o in options if o in own)}")
    lines += [
        "",
        "model=PRESET picks an encoder, a projector and a foundation together; each can then be swapped alone:",
        "  loong-vlm train model=tiny foundation=deepseek_v3_tiny model.family=custom model.mrope_section=null",
        "  loong-vlm train model=qwen2_5_vl_3b data.path=chat.jsonl data.processor=./processor",
        "keys: model.{family,preset,mrope_section,mrope_interleaved,freeze,lr_mult,init_from_hf},",
        "  encoder.* / projector.* (the vision side), foundation.* (any loong-llm model key),",
        "  data.{path,processor,media_root,chat_format,chat_template,min_pixels,max_pixels,video_min_pixels,",
        "  video_max_pixels,max_tiles,fps,max_frames,positions,packing,overlong,on_error,num_workers,",
        "  valid_fraction,synthetic_size,synthetic_seed}, train.{steps,seq_length,global_batch_size,",
        "  micro_batch_size,lr,...}, parallel.{tp,pp,ep,sequence_parallel}, output_dir, run_name",
    ]
    return "\n".join(lines)


def _setup_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides")


def _run_train(args: argparse.Namespace) -> int:
    from loong.vlm.schema import VLMRunConfig

    return run_train(CONFIG_MODULE, CONFIG_NAME, args.overrides, VLMRunConfig)


def _setup_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a Hugging Face VLM folder, or a Loong checkpoint (run, checkpoints or step dir)")
    p.add_argument("dst", help="output folder")
    p.add_argument("--processor", default=None, metavar="DIR",
                   help="Loong -> HF: the processor folder to write beside the weights (default: the checkpoint's)")

    add_convert_options(p, dtype_help="dtype of the written weights (auto: the source's, both ways)",
                        shard_default="5GB", shard_help=HF_SHARDS_HELP)

def _run_convert(args: argparse.Namespace) -> int:
    from loong.core.checkpoint.safetensors_io import parse_size
    from loong.vlm.convert import convert

    out, summary = convert(args.src, args.dst, dtype=args.dtype, processor=args.processor,
                           max_shard_bytes=parse_size(args.max_shard_size), progress=not args.no_progress,
                           check=args.verify)
    print(f"wrote {out}", file=sys.stderr)
    if summary is not None:
        print(summary, file=sys.stderr)
    return 0


main = make_cli(
    prog="loong-vlm",
    description="Train vision-language models (Qwen2.5-VL, Qwen3-VL, InternVL 3.5; any loong-llm foundation) on "
                "megatron-core, on CPU or GPUs.",
    module="loong.vlm.cli",
    commands={
        "train": Command("train a VLM (default: a tiny Qwen2.5-VL on synthetic shape captions, on CPU)",
                         _setup_train, _run_train),
        "convert": Command("convert a Hugging Face VLM folder to a Loong checkpoint, or back (direction from SRC)",
                           _setup_convert, _run_convert),
    },
    epilog=_presets_epilog,
)

if __name__ == "__main__":
    sys.exit(main())
