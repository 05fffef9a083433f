"""``loong-llm``: train dense LLMs and convert checkpoints to and from Hugging Face."""

from __future__ import annotations

import argparse
import os
import sys

from loong.core.cli import HF_SHARDS_HELP, Command, add_convert_options, make_cli, run_train

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
        "  loong-llm train task=sft train.seq_length=256          (chat data; see docs/data.md)",
        "keys: task (pretrain|sft), model.* (incl. model.lora.{rank,alpha,dropout,targets}),",
        "  data.{path,paths,split,format,text_field,tokenizer,chat_format,chat_template,packing,",
        "  overlong,on_error}, train.{steps,seq_length,",
        "  global_batch_size,micro_batch_size,lr,...}, parallel.{tp,pp,vpp,cp,ep,sequence_parallel},",
        "  output_dir, run_name",
    ]
    return "\n".join(lines)


def _setup_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides")


def _run_train(args: argparse.Namespace) -> int:
    from loong.llm.schema import LLMRunConfig

    return run_train(CONFIG_MODULE, CONFIG_NAME, args.overrides, LLMRunConfig)


def _setup_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a Hugging Face model folder, or a Loong checkpoint (run, checkpoints or step dir)")
    p.add_argument("dst", help="output folder")
    p.add_argument("--merge-lora", action="store_true",
                   help="merge a LoRA checkpoint's adapters into the base weights (needed for LoRA checkpoints)")

    add_convert_options(p, dtype_help="dtype of the written weights (auto: the source's, both ways)",
                        shard_default="5GB", shard_help=HF_SHARDS_HELP)

def _run_convert(args: argparse.Namespace) -> int:
    from loong.llm.convert import convert
    from loong.llm.hf_io import parse_size

    out, summary = convert(args.src, args.dst, dtype=args.dtype, merge_lora=args.merge_lora,
                           max_shard_bytes=parse_size(args.max_shard_size), progress=not args.no_progress,
                           check=args.verify)
    print(f"wrote {out}", file=sys.stderr)
    if summary is not None:
        print(summary, file=sys.stderr)
    return 0


def _setup_preprocess(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text (one document per line), .jsonl or .parquet files")
    p.add_argument("--output-prefix", required=True, metavar="P", help="writes P.bin, P.idx and P.json")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="local Hugging Face tokenizer folder (default: the packaged tokenizer)")
    p.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text (text)")
    p.add_argument("--format", default="auto", choices=["auto", "text", "jsonl", "parquet"],
                   help="input format (auto: from each file's suffix)")
    p.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 1))),
                   help="tokenising processes (default: the CPU count, at most 8)")
    p.add_argument("--on-error", default="raise", choices=["raise", "skip"],
                   help="a malformed record fails the run (raise) or is counted and skipped (skip)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_preprocess(args: argparse.Namespace) -> int:
    from loong.llm.data.preprocess import preprocess

    s = preprocess(args.inputs, args.output_prefix, tokenizer=args.tokenizer, fmt=args.format,
                   text_field=args.text_field, workers=args.workers, on_error=args.on_error,
                   progress=not args.no_progress)
    print(f"wrote {s['output_prefix']}.{{bin,idx,json}} ({s['dtype']} tokens)\n"
          f"documents: {s['documents']}\ntokens: {s['tokens']}\n"
          f"skipped: {s['skipped']} ({s['skipped_empty']} empty, {s['skipped_invalid']} invalid)\n"
          f"seconds: {s['seconds']} (tokenising {s['tokenize_seconds']})\ntokens/s: {s['tokens_per_s']}")
    return 0


main = make_cli(
    prog="loong-llm",
    description="Train dense LLMs (LLaMA 2/3/3.1, Qwen2/2.5, Qwen3) on megatron-core, on CPU or GPUs.",
    module="loong.llm.cli",
    commands={
        "train": Command("train a model (default: the tiny model on the shipped corpus, on CPU)",
                         _setup_train, _run_train),
        "preprocess": Command("tokenise text/JSONL/Parquet into indexed shards for data.path / data.paths",
                              _setup_preprocess, _run_preprocess),
        "convert": Command("convert a Hugging Face folder to a Loong checkpoint, or back (direction from SRC)",
                           _setup_convert, _run_convert),
    },
    epilog=_presets_epilog,
)

if __name__ == "__main__":
    sys.exit(main())
