"""VLA training throughput on one GPU: ``lerobot-train`` (lerobot 0.6.1) against ``loong-embodied train``.

Pi0.5 and GR00T N1.7 at their published shapes (random weights) train on the same LeRobotDataset v3 with the
same batch size, side by side in one run, each row in its own process (``lerobot-train`` or ``loong-embodied
train`` as a user starts it, so each has clean memory statistics); GR00T N1.6 has no installable baseline and
runs as a Loong row alone. Issue #23's "On the H200" target: Loong >= 2x ``lerobot-train``'s samples/s for both
policies, in less memory.

The dataset: the synthetic reach task's LeRobotDataset (``loong.embodied.data.synthetic.write_reach_dataset``,
written through lerobot's own writer), two cameras (``top``, ``wrist``) at ``--image-size``² (224) stored as AV1
video and decoded by PyAV in the DataLoader workers, 2-D state and 2-D action (padded by both frameworks to the
policy's max widths: Pi0.5 32, GR00T 132). The scripted expert is run with a large action noise
(``--expert-noise 10``, ``--max-steps 400``), which makes its episodes long (the default 8: 29-178 frames, 602 in
all): lerobot's GR00T drops the last 39 frames of every episode (``drop_n_last_frames``, a full 40-step action
chunk), so the task's usual 10-25-frame episodes would leave it no sample. What the frames show does not change the cost.

Rows (:data:`ROWS`; ``--rows`` picks):

- ``pi05/lerobot``: ``lerobot-train --policy.type=pi05 --policy.dtype=bfloat16``, otherwise its defaults
  (PaliGemma gemma_2b + gemma_300m expert, chunk 50, 200 prompt tokens, AdamW 2.5e-5 with its cosine schedule);
- ``pi05/lerobot_gc``: the same with ``--policy.gradient_checkpointing=true``;
- ``pi05/loong``: ``loong-embodied train model.policy=pi05 model.preset=pi05`` (bf16, the same batch);
- ``groot_n1_7/lerobot``: ``lerobot-train --policy.type=groot --policy.base_model_path=<the stand-in base>``
  with its defaults (backbone frozen: ``tune_llm`` / ``tune_visual`` false; fp32 weights, bf16 autocast);
- ``groot_n1_7/loong``: ``loong-embodied train model.policy=groot_n1_7 model.preset=groot_n1_7``;
- ``groot_n1_7/loong_ddp``, ``groot_n1_7/loong_graphs``, ``pi05/loong_graphs``: the Loong row with
  ``parallel.fsdp=none`` (replicated weights: on one GPU FSDP2 only costs its per-block casts), and with
  ``train.cuda_graphs=true`` as well (each micro-batch's forward + backward replayed as one CUDA graph);
  ``pi05/loong_graphs_mb16`` with ``train.micro_batch_size=16`` too (micro-batch 32 did not fit with graphs), and
  ``groot_n1_6/loong_graphs`` (not measured yet);
- ``pi05/loong_fp8``: the Loong row with ``precision.fp8=tensorwise`` (its linear layers' GEMMs in FP8), and
  ``pi05/loong_graphs_mb16_fp8``: the graphs row at micro-batch 16 with FP8 linears as well;
- ``groot_n1_6/loong``: ``loong-embodied train model.policy=groot_n1_6 model.preset=groot_n1_6`` (no baseline).

Columns (medians over the steps after ``--warmup``): seconds per step (lerobot: its ``updt_s + data_s``, the
time its own ``smp/s`` divides by; Loong: the wall time between consecutive per-step metrics records), samples/s
(batch / step time), data wait per step (lerobot's ``data_s``: waiting for the DataLoader plus its host-side
preprocessor; Loong's: the key in :data:`vla_rows.LOONG_DATA_KEYS` its task logs, "-" when none), peak memory
as each framework logs it (both ``torch.cuda.max_memory_allocated``: lerobot's per-step ``mem_gb`` in 10⁹ bytes,
converted to GiB; Loong's ``peak_memory_gib``), the GPU memory ``nvidia-smi`` saw in use during the row (polled
every 0.5 s, less what was in use before: CUDA context, allocator cache and workers included), the last loss,
and samples/s and memory against the ``lerobot`` row of the same policy.

Offline: nothing is downloaded. lerobot's hard-coded hub ids (``google/paligemma-3b-pt-224``'s tokenizer,
``nvidia/Cosmos-Reason2-2B``'s processor) resolve from a hub cache this script seeds with stand-ins of the right
shape, and GR00T's base model is lerobot's own ``GR00TN17`` at the published config with random weights, saved
to a local folder (:mod:`vla_rows` says exactly what each stand-in is). They are not the real files: the figures
are throughput and memory, not accuracy.

    # on the H200, after installing the wheels of benchmarks/vla_wheels.txt (it says how); every row together
    # passes a device command's 10 minutes, so split them and --merge (the JSON is rewritten after every row):
    python benchmarks/vla_throughput.py --rows pi05/lerobot pi05/lerobot_gc pi05/loong --row-timeout 240
    python benchmarks/vla_throughput.py --rows groot_n1_7/lerobot groot_n1_7/loong groot_n1_6/loong \
        --row-timeout 240 --merge benchmarks/results/vla_throughput_h200_published_<date>.json
    python benchmarks/vla_throughput.py --smoke                            # CPU: tiny presets, 3 steps

``--smoke`` (the CPU check that the whole path runs): 32² images, 12 episodes, batch 2, 3 steps, no workers,
fp32, Loong's ``tiny`` presets and a tiny GR00T N1.7 base for lerobot's row; ``pi05/lerobot*`` skip themselves
there (lerobot's Pi0.5 has no size knobs: 4.1B parameters, 18 GB to build on a CPU).

Prints a table and writes JSON (each row's exact command, versions, hardware, settings, the stand-ins, the
per-step figures) to ``benchmarks/results/vla_throughput_<gpu>_<mode>_<date>.json``; a row that fails is recorded
with its error and the run goes on. ``--merge`` adds rows to an earlier result of the same settings.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import _env
from _env import host, run_child, versions  # benchmarks/_env.py (run as scripts from the repo root)

RESULTS = Path(__file__).parent / "results"
#: what `lerobot-train` measured before issue #23 (shared/research/h200-wave2-anchors.md), for the printed table
ANCHORS = {"pi05/lerobot": "anchor 2026-12-01: 0.861 s/step, 37 samples/s, 136.0 GB",
           "pi05/lerobot_gc": "anchor 2026-12-01: 1.45 s/step, 22 samples/s, 39.6 GB"}
SETTINGS = ("smoke", "image_size", "episodes", "expert_noise", "max_steps", "batch", "steps", "warmup", "workers",
            "seed")


@dataclass(frozen=True)
class Row:
    """A benchmark row: its label, the function that runs it in the row's own process (returns
    :func:`vla_rows.figures` plus anything else for the JSON), and why it cannot run in ``--smoke``, if so."""

    label: str
    run: Callable[[argparse.Namespace, dict, Path], dict]
    smoke: str | None = None
    groot_base: bool = False  # needs the GR00T N1.7 base folder


def _lerobot(policy: str, *extra: str) -> Callable[[argparse.Namespace, dict, Path], dict]:
    def run(args: argparse.Namespace, prep: dict, tmp: Path) -> dict:
        from vla_rows import run_lerobot

        return run_lerobot(policy, args, prep, tmp, list(extra))
    return run


def _loong(policy: str, preset: str, *extra: str) -> Callable[[argparse.Namespace, dict, Path], dict]:
    def run(args: argparse.Namespace, prep: dict, tmp: Path) -> dict:
        from vla_rows import run_loong

        return run_loong(policy, "tiny" if args.smoke else preset, args, prep, tmp, [*extra, *args.loong_extra])
    return run


#: the overrides of the ``*_graphs`` rows (``_ddp``: the same without graphs, the eager step they replace)
DDP = ("parallel.fsdp=none",)
GRAPHS = (*DDP, "train.cuda_graphs=true")


_NO_GRAPHS_ON_CPU = "CUDA graphs need a GPU"
_NO_FP8_ON_CPU = "FP8 matrix products need a GPU of compute capability >= 8.9"
_NO_TINY_PI05 = "lerobot's Pi0.5 has no size knobs (4.1B parameters, about 18 GB and 6 min to build on a CPU)"
ROWS: dict[str, Row] = {
    "pi05/lerobot": Row("lerobot-train, bf16", _lerobot("pi05"), smoke=_NO_TINY_PI05),
    "pi05/lerobot_gc": Row("lerobot-train, bf16, gradient ckpt", _lerobot("pi05", "--policy.gradient_checkpointing=true"),
                           smoke=_NO_TINY_PI05),
    "pi05/loong": Row("loong-embodied train, bf16", _loong("pi05", "pi05")),
    "pi05/loong_graphs": Row("loong-embodied train, bf16, CUDA graphs (no FSDP)", _loong("pi05", "pi05", *GRAPHS),
                              smoke=_NO_GRAPHS_ON_CPU),
    # at micro-batch 32 the graph's pool did not fit beside Pi0.5's fp32 weights, gradients and Adam state
    # (results/vla_throughput_h200_pi05_graphs_oom_20261204.json): two micro-batches of 16 replay one graph twice
    "pi05/loong_graphs_mb16": Row("loong-embodied train, bf16, CUDA graphs (no FSDP), micro-batch 16",
                                  _loong("pi05", "pi05", *GRAPHS, "train.micro_batch_size=16"),
                                  smoke=_NO_GRAPHS_ON_CPU),
    # FP8 linears (docs/fp8.md, "On the fsdp engine"); the CPU accelerator has no fp8 capability: refused there
    "pi05/loong_fp8": Row("loong-embodied train, bf16, FP8 linears (tensorwise)",
                          _loong("pi05", "pi05", "precision.fp8=tensorwise"), smoke=_NO_FP8_ON_CPU),
    "pi05/loong_graphs_mb16_fp8": Row("loong-embodied train, bf16, CUDA graphs (no FSDP), micro-batch 16, FP8",
                                      _loong("pi05", "pi05", *GRAPHS, "train.micro_batch_size=16",
                                             "precision.fp8=tensorwise"), smoke=_NO_GRAPHS_ON_CPU),
    "groot_n1_7/lerobot": Row("lerobot-train (its defaults)", _lerobot("groot"), groot_base=True),
    "groot_n1_7/loong": Row("loong-embodied train, bf16", _loong("groot_n1_7", "groot_n1_7")),
    "groot_n1_7/loong_ddp": Row("loong-embodied train, bf16, no FSDP", _loong("groot_n1_7", "groot_n1_7", *DDP)),
    "groot_n1_7/loong_graphs": Row("loong-embodied train, bf16, CUDA graphs (no FSDP)",
                                   _loong("groot_n1_7", "groot_n1_7", *GRAPHS), smoke=_NO_GRAPHS_ON_CPU),
    "groot_n1_6/loong": Row("loong-embodied train, bf16", _loong("groot_n1_6", "groot_n1_6")),
    "groot_n1_6/loong_graphs": Row("loong-embodied train, bf16, CUDA graphs (no FSDP)",
                                   _loong("groot_n1_6", "groot_n1_6", *GRAPHS), smoke=_NO_GRAPHS_ON_CPU),
}
SMOKE_DEFAULTS = dict(image_size=32, episodes=12, batch=2, steps=3, warmup=1, workers=0)
PUBLISHED_DEFAULTS = dict(image_size=224, episodes=8, batch=32, steps=20, warmup=8, workers=8)


# ---------------------------------------------------------------------------------------------------- children


def _settings_argv(args: argparse.Namespace) -> list[str]:
    out = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in SETTINGS if k != "smoke"]
    return out + (["--smoke"] if args.smoke else []) + [f"--work-dir={args.work_dir}"] + [
        f"--loong-extra={x}" for x in args.loong_extra]


def _prepare_child(args: argparse.Namespace) -> None:
    from vla_rows import prepare

    groot = any(ROWS[r].groot_base and not (args.smoke and ROWS[r].smoke) for r in args.rows)
    print(json.dumps({"hardware": host()} | prepare(Path(args.work_dir), smoke=args.smoke, image_size=args.image_size,
                             episodes=args.episodes, noise=args.expert_noise, max_steps=args.max_steps, groot=groot)))


def _worker_child(args: argparse.Namespace) -> None:
    prep = json.loads(Path(args.prep).read_text())
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        print(json.dumps(ROWS[args.worker].run(args, prep, Path(tmp))))


def _last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the child's output")


def _error(text: str) -> str:
    if "OutOfMemoryError" in text or "CUDA out of memory" in text:
        return "out of memory\n" + text[-1500:]
    return text[-4000:]


def _run_row(name: str, args: argparse.Namespace, prep_path: Path) -> dict:
    cmd = [sys.executable, __file__, f"--worker={name}", f"--prep={prep_path}", *_settings_argv(args)]
    t0 = time.time()
    # one child at a time, so ending "the children" at the deadline ends this row's (lerobot's workers included)
    timer = threading.Timer(args.row_timeout, _env._kill_children) if args.row_timeout else None
    if timer:
        timer.start()
    try:
        proc = run_child(cmd)
    finally:
        if timer:
            timer.cancel()
    command = " ".join(["python", "benchmarks/" + Path(__file__).name, *cmd[2:]])
    if args.row_timeout and time.time() - t0 >= args.row_timeout:
        return {"error": f"stopped at --row-timeout {args.row_timeout} s\n{_error(proc.stdout + proc.stderr)}",
                "worker_command": command}
    if proc.returncode:
        return {"error": _error(proc.stdout + proc.stderr), "worker_command": command}
    try:
        out = _last_json(proc.stdout)
    except ValueError:
        return {"error": _error(proc.stdout + proc.stderr), "worker_command": command}
    return {**out, "worker_command": command, "wall_s": round(time.time() - t0, 1)}


# ---------------------------------------------------------------------------------------------------- table


def table(rows: dict[str, dict]) -> list[str]:
    """One block per policy, each row against that policy's ``lerobot`` row."""
    head = (f"{'row':<38}{'s/step':>8}{'samples/s':>11}{'data wait':>11}{'peak GiB':>10}{'smi GiB':>9}"
            f"{'loss':>9}{'vs lerobot':>12}{'mem vs lerobot':>16}")
    lines = [head]
    for policy in dict.fromkeys(k.split("/")[0] for k in rows):
        base = rows.get(f"{policy}/lerobot", {})
        lines.append(policy)
        for key, r in rows.items():
            if key.split("/")[0] != policy:
                continue
            label = "  " + (ROWS[key].label if key in ROWS else key.split("/")[1])
            if "error" in r or "skipped" in r:
                why = r.get("skipped") or (r["error"].strip().splitlines() or ["?"])[-1]
                lines.append(f"{label:<38}  {'skipped' if 'skipped' in r else 'failed'}: {why[:110]}")
                continue

            def num(v: float | None, fmt: str) -> str:
                return format(v, fmt) if v is not None else "-"
            vs = (f"{r['samples_per_s'] / base['samples_per_s']:.2f}x"
                  if base.get("samples_per_s") and key != f"{policy}/lerobot" else "-")
            mvs = (f"{r['peak_memory_gib'] / base['peak_memory_gib']:.2f}x"
                   if r.get("peak_memory_gib") and base.get("peak_memory_gib") and key != f"{policy}/lerobot" else "-")
            lines.append(f"{label:<38}{r['s_per_step']:>8.3f}{r['samples_per_s']:>11.1f}"
                         f"{num(r.get('data_wait_s'), '.4f'):>11}{num(r.get('peak_memory_gib'), '.1f'):>10}"
                         f"{num(r.get('nvidia_smi_peak_gib'), '.1f'):>9}{num(r.get('loss_last'), '.4f'):>9}"
                         f"{vs:>12}{mvs:>16}")
    return lines


# ---------------------------------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--smoke", action="store_true", help="CPU check: tiny presets, tiny images, 3 steps")
    p.add_argument("--image-size", type=int, default=None, help="camera side, pixels (224; smoke 32)")
    p.add_argument("--episodes", type=int, default=None, help="expert episodes in the dataset (8; smoke 12)")
    p.add_argument("--expert-noise", type=float, default=10.0, help="the reach expert's action noise (long episodes)")
    p.add_argument("--max-steps", type=int, default=400, help="longest episode the expert may take")
    p.add_argument("--batch", type=int, default=None, help="samples per step, both frameworks (32; smoke 2)")
    p.add_argument("--steps", type=int, default=None, help="training steps per row (20; smoke 3)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the medians (8; smoke 1)")
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers, both frameworks (8; smoke 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default=None, help="dataset, seeded hub cache, GR00T base, run folders "
                                                    "(default: a folder under the system temp dir, kept)")
    p.add_argument("--loong-extra", action="append", default=[], help="an extra override for every Loong row")
    p.add_argument("--row-timeout", type=float, default=0, help="seconds a row may take before it is stopped and "
                                                                  "recorded as failed (0: no limit)")
    p.add_argument("--merge", default=None, help="an earlier result JSON (same settings) to add these rows to")
    p.add_argument("--out", default=None, help="JSON path (default: results/vla_throughput_<gpu>_<mode>_<date>.json)")
    p.add_argument("--worker", default=None, choices=list(ROWS), help=argparse.SUPPRESS)
    p.add_argument("--prep", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    for k, v in (SMOKE_DEFAULTS if args.smoke else PUBLISHED_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.work_dir = args.work_dir or str(Path(tempfile.gettempdir()) / ("vla_bench_smoke" if args.smoke else "vla_bench"))
    if args.prepare:
        _prepare_child(args)
        return
    if args.worker:
        _worker_child(args)
        return
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup} to time")

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    print(f"preparing the dataset and stand-ins in {work} ...", flush=True)
    t0 = time.time()
    proc = run_child([sys.executable, __file__, "--prepare", "--rows", *args.rows, *_settings_argv(args)])
    if proc.returncode:
        sys.exit(f"preparing failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    prep = _last_json(proc.stdout)
    prep_path = work / "prep.json"
    prep_path.write_text(json.dumps(prep, indent=2))
    print(f"  dataset {prep['dataset']['root']}: {prep['dataset']['episodes']} episodes, {prep['dataset']['frames']} "
          f"frames; {round(time.time() - t0, 1)} s", flush=True)

    rows: dict[str, dict] = {}
    commands: list[str] = []
    if args.merge:
        earlier = json.loads(Path(args.merge).read_text())
        differ = {k: (earlier["args"][k], getattr(args, k)) for k in SETTINGS if earlier["args"][k] != getattr(args, k)}
        if differ:
            p.error(f"--merge {args.merge}: settings differ (earlier, now): {differ}")
        rows, commands = earlier["rows"], earlier["commands"]
    write = _writer(args, prep, commands)
    for name in args.rows:
        if args.smoke and ROWS[name].smoke:
            rows[name] = {"skipped": ROWS[name].smoke}
            print(f"  {name}: skipped ({ROWS[name].smoke})", flush=True)
            continue
        print(f"running {name} ...", flush=True)
        r = rows[name] = _run_row(name, args, prep_path)
        print(f"  {name}: " + (f"{r['samples_per_s']:.1f} samples/s, {r['s_per_step']:.3f} s/step, {r['wall_s']} s"
                               if "samples_per_s" in r else "failed: " + (r["error"].strip().splitlines() or ["?"])[-1][:200]),
              flush=True)
        write(rows)
    write(rows, final=True)


def _writer(args: argparse.Namespace, prep: dict, commands: list[str]) -> Callable[..., None]:
    """``write(rows)``: the result JSON with the rows so far (after every row, so a command stopped at the
    device's time limit still leaves the finished rows); ``final=True`` also prints the table."""
    command = " ".join(["python", "benchmarks/" + Path(sys.argv[0]).name, *sys.argv[1:]])
    heading = (f"{'smoke (CPU, tiny presets)' if args.smoke else 'published shapes'}: batch {args.batch}, "
               f"{args.steps} steps (medians after {args.warmup}), {args.workers} workers, two {args.image_size}² AV1 "
               f"cameras (PyAV), {prep['dataset']['episodes']} episodes / {prep['dataset']['frames']} frames")
    hw = prep["hardware"]
    tag = (hw.get("gpu") or "cpu").split()[-1].lower()
    mode = "smoke" if args.smoke else "published"
    out = Path(args.merge or args.out or RESULTS / f"vla_throughput_{tag}_{mode}_{time.strftime('%Y%m%d')}.json")
    vers = versions(["torch", "transformers", "lerobot", "accelerate", "diffusers", "datasets", "av", "torchcodec",
                     "numpy", "loong-core", "loong-kernels", "loong-embodied"])

    def write(rows: dict[str, dict], final: bool = False) -> None:
        rows = {k: rows[k] for k in ROWS if k in rows}
        lines = table(rows)
        result = {"benchmark": "vla_throughput", "date": time.strftime("%Y-%m-%d"), "commands": [*commands, command],
                  "args": {k: getattr(args, k) for k in (*SETTINGS, "rows", "loong_extra")}, "heading": heading,
                  "versions": vers, "hardware": hw, "prepared": prep, "anchors": ANCHORS, "table": lines,
                  "rows": rows, "complete": final}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        if final:
            print(f"\n{heading}\n" + "\n".join(lines))
            for key, note in ANCHORS.items():
                if key in rows and not args.smoke:
                    print(f"  ({key}: {note})")
            print(f"wrote {out}")

    return write

if __name__ == "__main__":
    main()
