"""``loong-llm``: train dense LLMs and convert checkpoints to and from Hugging Face."""

from __future__ import annotations

import argparse
import sys

from loong.core.cli import Command, make_cli

CONFIG_MODULE = "loong.llm.configs"
CONFIG_NAME = "pretrain"


def _presets_epilog() -> str:
    from loong.core.config import config_groups

    lines = ["config groups (choose with GROUP=OPTION):"]
    for group, options in config_groups(CONFIG_MODULE).items():
        lines.append(f"  {group}: {', '.join(options)}")
    lines += [
        "",
        "any key can be overridden with dotted KEY=VALUE, e.g.:",
        "  loong-llm train model=qwen3_0_6b data.path=corpus.jsonl train.steps=1000 parallel.tp=2",
        "keys: model.*, data.{path,format,text_field,tokenizer}, train.{steps,seq_length,",
        "  global_batch_size,micro_batch_size,lr,...}, parallel.{tp,pp,vpp,cp,ep,sequence_parallel},",
        "  output_dir, run_name",
    ]
    return "\n".join(lines)


def _setup_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides")


def _run_train(args: argparse.Namespace) -> int:
    from loong.core.run import train
    from loong.llm.schema import LLMRunConfig

    def echo(msg: str) -> None:
        print(msg, file=sys.stderr)

    result = train(CONFIG_MODULE, CONFIG_NAME, args.overrides, LLMRunConfig, echo=echo)
    if result.first_loss is not None and result.last_loss is not None:
        drop = 1 - result.last_loss / result.first_loss
        print(f"loss {result.first_loss:.4f} -> {result.last_loss:.4f} ({drop:.0%} lower) "
              f"in {result.summary['steps']} steps, {result.summary['wall_s']} s", file=sys.stderr)
        print(f"wrote {result.run_dir}/: checkpoints/ ({result.checkpoint.name if result.checkpoint else '-'}), "
              f"metrics.jsonl, tensorboard/, loss.png" + (f", hf/ ({result.hf_dir})" if result.hf_dir else ""),
              file=sys.stderr)
    if result.interrupted:
        print(f"interrupted: saved {result.checkpoint}; rerun with run_name={result.run_dir.name} "
              "to resume", file=sys.stderr)
    return 0


def _setup_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a Hugging Face model folder, or a Loong checkpoint (run, checkpoints or step dir)")
    p.add_argument("dst", help="output folder")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32", "fp16"], default="auto",
                   help="dtype of the written Hugging Face weights (auto: as saved)")


def _run_convert(args: argparse.Namespace) -> int:
    from loong.llm.convert import convert

    out = convert(args.src, args.dst, dtype=args.dtype)
    print(f"wrote {out}", file=sys.stderr)
    return 0


main = make_cli(
    prog="loong-llm",
    description="Train dense LLMs (LLaMA 2/3/3.1, Qwen2/2.5, Qwen3) on megatron-core, on CPU or GPUs.",
    module="loong.llm.cli",
    commands={
        "train": Command("train a model (default: the tiny model on the shipped corpus, on CPU)",
                         _setup_train, _run_train),
        "convert": Command("convert a Hugging Face folder to a Loong checkpoint, or back (direction from SRC)",
                           _setup_convert, _run_convert),
    },
    epilog=_presets_epilog,
)

if __name__ == "__main__":
    sys.exit(main())
