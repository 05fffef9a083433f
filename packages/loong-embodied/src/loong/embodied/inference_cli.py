"""The ``eval`` and ``serve`` sub-commands of ``loong-embodied`` (:data:`EVAL_COMMAND`, :data:`SERVE_COMMAND`,
added to its :func:`~loong.core.cli.make_cli` by :mod:`loong.embodied.cli`). Heavy imports wait for ``run``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml

from loong.core.cli import Command
from loong.core.errors import LoongError

CKPT_HELP = ("a loong-embodied run folder, its checkpoints/ folder (both: the newest complete step) or one "
             "checkpoints/step_N folder")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", metavar="CKPT", help=CKPT_HELP)
    p.add_argument("--ema", action="store_true",
                   help="use the checkpoint's moving averages of the weights (train.ema_decay)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="compute dtype (auto: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--source", default=None, metavar="N|NAME",
                   help="for a policy trained on a mix of datasets: the dataset (index, folder or folder name) "
                        "whose normalisation statistics and embodiment the robot's observations and actions use "
                        "(default: 0, the first)")


def parse_env_kwargs(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs with YAML values (``image_size=96``, ``num_targets=null``)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.isidentifier():
            raise LoongError(f"--env-kwarg {pair!r}: must be KEY=VALUE, e.g. max_steps=80")
        out[key] = yaml.safe_load(value) if value else ""
    return out


def _setup_eval(p: argparse.ArgumentParser) -> None:
    from loong.embodied.eval import DEFAULT_ENV

    _common(p)
    p.add_argument("--env", default=DEFAULT_ENV,
                   help="a gymnasium env id, or module:Id to import another package's (default: %(default)s)")
    p.add_argument("--env-kwarg", action="append", default=[], metavar="KEY=VALUE",
                   help="a keyword of the env's constructor (repeatable), e.g. max_steps=80")
    p.add_argument("--episodes", type=int, default=20, help="episodes, seeds SEED.. (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the first episode's seed (default: %(default)s)")
    p.add_argument("--n-action-steps", type=int, default=None,
                   help="actions of each predicted chunk executed before predicting again (default: the policy's)")
    p.add_argument("--max-steps", type=int, default=None, help="cut episodes at this many steps (default: the env's)")
    p.add_argument("--no-random", action="store_true", help="skip the random-policy baseline")
    p.add_argument("--record", type=int, default=4, metavar="K",
                   help="rollouts shown in the GIF and PNG strip (default: %(default)s; 0: none)")
    p.add_argument("--output", "-o", default=None, metavar="DIR", help="where to write (default: <run>/eval/)")
    p.add_argument("--json", action="store_true", help="print the whole summary as JSON on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _rate(block: dict[str, Any]) -> str:
    return (f"success {block['success_rate']:.1%} ({block['successes']}/{block['episodes']}), "
            f"mean return {block['mean_return']:.3f}, mean length {block['mean_length']:.1f}")


def _run_eval(args: argparse.Namespace) -> int:
    from loong.embodied.eval import evaluate

    summary = evaluate(args.ckpt, env_id=args.env, env_kwargs=parse_env_kwargs(args.env_kwarg),
                       episodes=args.episodes, seed=args.seed, ema=args.ema, device=args.device, dtype=args.dtype,
                       n_action_steps=args.n_action_steps, max_steps=args.max_steps,
                       random_baseline=not args.no_random, record=args.record, output=args.output,
                       progress=not args.no_progress, source=args.source)
    weights = "EMA weights" if summary["ema"] else "weights"
    print(f"{summary['policy_name']} step {summary['step']} ({weights}) on {summary['env']}, seeds "
          f"{summary['seeds'][0]}..{summary['seeds'][1]}:", file=sys.stderr)
    print(f"  policy: {_rate(summary['policy'])}", file=sys.stderr)
    if "random" in summary:
        print(f"  random: {_rate(summary['random'])}", file=sys.stderr)
        print(f"  margin: {summary['margin']:+.1%} success over random", file=sys.stderr)
    print(f"wrote {', '.join(summary['files'])} ({summary['seconds']} s)", file=sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


EVAL_COMMAND = Command(
    "closed-loop rollouts of a trained policy in a gymnasium env (default: the synthetic reach task): success "
    "rate and mean return beside the env's random policy; a JSON summary, GIF and PNG strip under <run>/eval/",
    _setup_eval, _run_eval,
)


def _setup_serve(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s, openpi's)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s, all)")
    p.add_argument("--map", action="append", default=[], metavar="CLIENT_KEY=POLICY_KEY",
                   help="map a client observation key (nested keys joined by /) to the policy's "
                        "(observation.images.<camera>, observation.state, task); repeatable; a trailing * maps a "
                        "family, e.g. --map observation/image=observation.images.top")
    p.add_argument("--key-map", default=None, metavar="FILE.json",
                   help="the same as a JSON object {client key: policy key}; --map entries win")
    p.add_argument("--no-default-map", action="store_true",
                   help="only the given entries (default: also prompt->task, state and observation/state->"
                        "observation.state, images/* and observation/images/*->observation.images.*)")
    p.add_argument("--default-prompt", default=None, help="the instruction when a client sends no prompt")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the action noise, re-seeded on every connection (default: %(default)s)")


def _run_serve(args: argparse.Namespace) -> int:
    from loong.embodied.serve import read_key_map, serve

    def ready(server: Any) -> None:
        meta = server.metadata
        print(f"serving {meta['policy']} step {meta['step']} on ws://{server.host}:{server.port} (openpi-client "
              f"protocol; cameras {meta['cameras']}, chunks of {meta['chunk_size']}); Ctrl-C stops",
              file=sys.stderr, flush=True)

    try:
        serve(args.ckpt, host=args.host, port=args.port, key_map=read_key_map(args.key_map, args.map),
              use_default_map=not args.no_default_map, ema=args.ema, device=args.device, dtype=args.dtype,
              seed=args.seed, default_task=args.default_prompt, source=args.source, on_ready=ready)
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    return 0


SERVE_COMMAND = Command(
    "serve a trained policy over websocket + msgpack to openpi's robot clients (openpi-client's "
    "WebsocketClientPolicy); observation keys mapped by --map / --key-map",
    _setup_serve, _run_serve,
)

__all__ = ["EVAL_COMMAND", "SERVE_COMMAND", "parse_env_kwargs"]
