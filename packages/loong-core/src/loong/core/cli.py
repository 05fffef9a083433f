"""The CLI kit: a modality's command is a few lines over :func:`make_cli`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loong.core.errors import LoongError


@dataclass
class Command:
    """A sub-command: ``setup(parser)`` adds arguments, ``run(args) -> exit code``."""

    help: str
    setup: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def quiet_third_party() -> None:
    """Silence import-time chatter (no TE/apex, deprecations) so the user sees Loong's own output."""
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|TE|apex).*")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    for name in ("megatron", "megatron.core", "torch.distributed", "torch.utils.cpp_extension"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def relaunch(nproc: int, module: str, argv: Sequence[str], max_restarts: int = 0) -> int:
    """Start ``python -m module argv`` in ``nproc`` processes through torch.distributed.run.

    ``max_restarts``: torchrun restarts the whole group this many times after a worker fails; the
    restarted run resumes from its last checkpoint (``train.resume=auto``) in its directory, which the config
    determines (:mod:`loong.core.run_dir`); the timestamp of a ``train.resume=none`` run's directory is fixed here
    (``LOONG_RUN_STAMP``) so that every attempt finds the same one.
    """
    from torch.distributed.run import main as torchrun

    os.environ.setdefault("LOONG_RUN_STAMP", time.strftime("%Y%m%d-%H%M%S"))
    args = ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "-m", module, *argv]
    try:
        torchrun(args)
    except SystemExit as exc:  # torchrun exits non-zero when a worker fails
        return int(exc.code or 0)
    except Exception as exc:  # ChildFailedError: workers already printed their error
        first = exc.get_first_failure()[1].exitcode if hasattr(exc, "get_first_failure") else None
        if first == 2:  # the workers refused the input (a config check): the command's answer to bad input
            return 2
        print(f"error: {type(exc).__name__}: a worker failed", file=sys.stderr)
        return 1
    return 0


LAUNCH_OPTIONS = ("--nproc-per-node", "--max-restarts")


def _strip_launch_options(argv: list[str]) -> tuple[dict[str, int], list[str]]:
    """Remove ``--nproc-per-node N`` and ``--max-restarts N`` (either form) from argv.

    Returns ``({option: value}, rest)``; the last occurrence wins; a dangling option is left for argparse.
    """
    def as_int(option: str, value: str) -> int:
        try:
            return int(value)
        except ValueError:
            raise LoongError(f"{option} expects an integer, got {value!r}") from None

    out, found, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        if arg in LAUNCH_OPTIONS and i + 1 < len(argv):
            found[arg], i = as_int(arg, argv[i + 1]), i + 2
            continue
        option, eq, value = arg.partition("=")
        if eq and option in LAUNCH_OPTIONS:
            found[option] = as_int(option, value)
        else:
            out.append(arg)
        i += 1
    return found, out


def run_train(config_module: str, config_name: str, overrides: list[str], schema: type,
              export_label: str = "hf/") -> int:
    """A modality's ``train`` command: the walk (progress on stderr), then what it did in two lines, on the
    logging rank (``export_label``: how the exported folder is named in the summary)."""
    from loong.core.run import train

    def echo(msg: str) -> None:
        print(msg, file=sys.stderr)

    result = train(config_module, config_name, overrides, schema, echo=echo)
    if not result.is_logging_rank or result.already_finished:  # the walk said so
        return 0
    if result.first_loss is not None and result.last_loss is not None:
        drop = 1 - result.last_loss / result.first_loss
        print(f"loss {result.first_loss:.4f} -> {result.last_loss:.4f} ({abs(drop):.0%} {'lower' if drop >= 0 else 'higher'}) "
              f"in {result.summary['steps']} steps, {result.summary['wall_s']} s", file=sys.stderr)
        print(f"wrote {result.run_dir}/: checkpoints/ ({result.checkpoint.name if result.checkpoint else '-'}), "
              f"metrics.jsonl, tensorboard/, loss.png" + (f", {export_label} ({result.hf_dir})" if result.hf_dir else ""),
              file=sys.stderr)
    if result.interrupted:
        how = ("rerun the same command" if result.rerun_continues
               else f"rerun with run_name={result.run_dir.name} train.resume=auto")
        print(f"interrupted: saved {result.checkpoint}; {how} to continue", file=sys.stderr)
    return 0


#: ``--max-shard-size`` of the converters that write a Hugging Face folder (transformers' 5GB default)
HF_SHARDS_HELP = ("largest safetensors shard written (Loong -> HF), e.g. 5GB, 500MB, 2GiB (default: 5GB); more than "
                  "one shard comes with model.safetensors.index.json")


def add_convert_options(p: argparse.ArgumentParser, *, dtype_help: str, shard_default: str | None = None,
                        shard_help: str = "", progress_help: str = "no progress bar") -> None:
    """The options every ``convert`` verb shares, with one meaning in every CLI: ``--dtype`` (``auto`` keeps the
    source's), ``--max-shard-size`` (only where the written format shards: pass ``shard_default``), ``--verify``
    and ``--no-progress``."""
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32", "fp16"], default="auto", help=dtype_help)
    if shard_default is not None:
        p.add_argument("--max-shard-size", default=shard_default, metavar="SIZE", help=shard_help)
    p.add_argument("--verify", action="store_true",
                   help="after converting, reread both sides and compare every tensor bit for bit (exit 2 on the "
                        "first that differs)")
    p.add_argument("--no-progress", action="store_true", help=progress_help)


def _setup_env(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _run_env(args: argparse.Namespace) -> int:
    from loong.core.env import main as env_report

    print(env_report(as_json=args.json))
    return 0


#: Added to every CLI built with :func:`make_cli` (a modality may define its own ``env`` instead).
ENV_COMMAND = Command(
    "print Loong's packages and versions, the accelerators and which one runs, and the distributed "
    "environment (the first thing to paste into a bug report)",
    _setup_env, _run_env,
)


def make_cli(prog: str, description: str, module: str, commands: dict[str, Command],
             epilog: Callable[[], str] | None = None) -> Callable[[Sequence[str] | None], int]:
    """Build ``main(argv) -> exit code`` for a modality command.

    ``module`` is the importable CLI module (used to relaunch under torchrun). Every command accepts
    ``--nproc-per-node N``; outside torchrun it relaunches itself in N processes. Every CLI also gets
    ``env`` (:data:`ENV_COMMAND`) unless ``commands`` defines one.
    """
    commands = {**commands, "env": commands.get("env", ENV_COMMAND)}

    def main(argv: Sequence[str] | None = None) -> int:
        quiet_third_party()
        argv = list(sys.argv[1:] if argv is None else argv)
        try:
            launch, rest = _strip_launch_options(argv)
        except LoongError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        nproc, restarts = launch.get("--nproc-per-node", 0), launch.get("--max-restarts", 0)
        if (nproc > 1 or restarts) and "TORCHELASTIC_RUN_ID" not in os.environ:
            return relaunch(max(nproc, 1), module, rest, max_restarts=restarts)
        parser = argparse.ArgumentParser(
            prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=epilog() if epilog else None,
        )
        parser.add_argument("--nproc-per-node", type=int, default=0,
                            help="processes on this node; relaunches through torch.distributed.run")
        parser.add_argument("--max-restarts", type=int, default=0,
                            help="restart all processes this many times after a failure (torchrun's "
                                 "elastic restarts); the run resumes from its last checkpoint")
        sub = parser.add_subparsers(dest="command", metavar="COMMAND")
        for name, cmd in commands.items():
            # The modality's epilog (its presets) is about training, not about `env`.
            p = sub.add_parser(name, help=cmd.help, description=cmd.help,
                               formatter_class=argparse.RawDescriptionHelpFormatter,
                               epilog=epilog() if epilog and cmd is not ENV_COMMAND else None)
            cmd.setup(p)
            p.set_defaults(_run=cmd.run)
        args = parser.parse_args(rest)
        if not getattr(args, "_run", None):
            parser.print_help()
            return 0
        try:
            return int(args._run(args) or 0)
        except LoongError as exc:
            if os.environ.get("RANK", "0") == "0":
                print(f"error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130

    return main


#: ``loong``: the commands every installation has, whichever modalities are installed (``loong env``).
main = make_cli(
    prog="loong",
    description="Loong's own commands; each modality adds its command (loong-llm, ...) with train etc.",
    module="loong.core.cli",
    commands={},
)

if __name__ == "__main__":
    sys.exit(main())
