"""``loong-embodied``: train VLA policies (Pi0.5, GR00T N1.7 / N1.6) on LeRobotDatasets with the fsdp engine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loong.core.cli import Command, add_convert_options, make_cli, run_train
from loong.embodied.inference_cli import EVAL_COMMAND, SERVE_COMMAND

CONFIG_MODULE = "loong.embodied.configs"
CONFIG_NAME = "train"


def _presets_epilog() -> str:
    from importlib import resources

    from loong.core.config import config_groups
    from loong.embodied.policies import POLICIES

    lines = ["config groups (choose with GROUP=OPTION):"]
    for group, options in config_groups(CONFIG_MODULE).items():
        lines.append(f"  {group}: {', '.join(options)}")
    folder = resources.files(CONFIG_MODULE) / "policy"
    lines += ["", f"policies (model.policy): {', '.join(POLICIES.names())}; each policy option sets model.policy "
                  "and model.preset:"]
    for option in sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")):
        head = (folder / f"{option}.yaml").read_text().splitlines()
        note = next((line.lstrip("# ").strip() for line in head if line.startswith("# ") and "@package" not in line),
                    "")
        lines.append(f"  {option}: {note}")
    lines += [
        "",
        "any key can be overridden with dotted KEY=VALUE, e.g.:",
        "  loong-embodied train train.steps=50 train.lr=1e-3 data.num_workers=2",
        "  loong-embodied train policy=groot_n1_7_tiny model.config.chunk_size=16",
        "  loong-embodied train policy=pi05 data.repo_root=/data/my_lerobot_dataset train.precision=bf16",
        "keys: model.{policy,preset,recompute,init_from}, model.config.<any field of the policy's config>,",
        "  data.{repo_root,weights,cameras,num_workers,video_backend,on_error} (repo_root: one LeRobotDataset v3",
        "  folder or a list; null: the synthetic reach task, data.synthetic_{episodes,seed,videos}),",
        "  train.{steps,global_batch_size,micro_batch_size,lr,...}, train.ema_decay=0.999 (EMA of the weights),",
        "  train.save_lerobot=true (+ train.export_ema=true: the EMA) writes <run>/lerobot/ (a mix: for the",
        "  dataset train.save_lerobot_dataset=N|NAME names, default the first),",
        "  parallel.{fsdp,dp_shard,dp_replicate}, output_dir, run_name",
    ]
    return "\n".join(lines)


def _setup_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides")


def _run_train(args: argparse.Namespace) -> int:
    from loong.embodied.schema import EmbodiedRunConfig, hydra_overrides

    return run_train(CONFIG_MODULE, CONFIG_NAME, hydra_overrides(args.overrides), EmbodiedRunConfig,
                     export_label="lerobot/")


def _setup_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a Loong checkpoint (run, checkpoints or step dir) or a lerobot policy folder "
                               "(config.json + model.safetensors)")
    p.add_argument("dst", help="output folder")
    p.add_argument("--ema", action="store_true",
                   help="write the checkpoint's moving averages of the weights (train.ema_decay) instead of the "
                        "weights (Loong -> lerobot)")
    p.add_argument("--dataset-index", default=None, metavar="N|NAME",
                   help="a policy trained on a mix of datasets: the dataset (its index in data.repo_root, its folder "
                        "or folder name) whose normalisation statistics and embodiment the lerobot folder carries "
                        "(default: 0, the first; Loong -> lerobot)")

    add_convert_options(p, dtype_help="dtype of the written floating weights, both ways (auto: the source's, as "
                        "saved)", progress_help="no progress bar (of the conversion and of --verify)")


def _run_convert(args: argparse.Namespace) -> int:
    src, dst = Path(args.src).expanduser(), Path(args.dst).expanduser()
    progress = not args.no_progress
    if (src / "config.json").is_file() and (src / "model.safetensors").is_file():
        from loong.embodied.lerobot_io import verify_import

        out = _lerobot_to_loong(src, dst, args.dtype, progress)
        print(f"wrote {out} (weights only); fine-tune from it: loong-embodied train train.resume={out} "
              f"data.repo_root=DATASET, or start from the lerobot folder itself: model.init_from={src}",
              file=sys.stderr)
        if args.verify:
            print(verify_import(src, out, progress=progress), file=sys.stderr)
        return 0
    import time

    import torch

    from loong.embodied.inference import locate_policy
    from loong.embodied.lerobot_io import CheckpointWeights, export_lerobot, target_dtype, verify_export

    target_dtype(args.dtype, torch.float32)  # a bad --dtype fails before anything is read
    spec, config, processor, step_dir, _ = locate_policy(src)
    with torch.device("meta"):  # the policy's names and shapes; its tensors are read one at a time as written
        expected = spec.policy_class(config).state_dict()
    state = CheckpointWeights(step_dir, expected, ema=args.ema, dtype=args.dtype)
    out = export_lerobot(spec.name, config, state, processor, dst, source=args.dataset_index, progress=progress)
    weights = "moving averages of the weights" if args.ema else "weights"
    print(f"wrote {out}: lerobot {spec.name} policy ({weights} of {step_dir}); load it with lerobot's "
          "from_pretrained", file=sys.stderr)
    if args.verify:  # the checkpoint reread (a fresh reader, as saved: the compare casts it), through the mapping
        start = time.perf_counter()
        source = CheckpointWeights(step_dir, expected, ema=args.ema)
        print(verify_export(out, spec.name, config, source, processor, source=args.dataset_index,
                            progress=progress, start=start), file=sys.stderr)
    return 0


def _lerobot_to_loong(src: Path, dst: Path, dtype: str = "auto", progress: bool = False) -> Path:
    """A weights-only Loong checkpoint ``dst/checkpoints/step_00000000`` of the lerobot policy folder ``src``, its
    config the preset nearest to the folder's plus the fields that differ (``model.config``), its floating tensors
    in ``dtype`` (``auto``: as the folder holds them). The folder is read one tensor at a time; the Loong state is
    held once, as torch DCP's save takes the whole state dict."""
    import torch.distributed.checkpoint as dcp

    from loong.core.checkpoint import CheckpointManager
    from loong.core.checkpoint.safetensors_io import progress_bar
    from loong.core.config.schema import to_dict
    from loong.embodied.lerobot_io import import_lerobot
    from loong.embodied.policies import POLICIES
    from loong.embodied.schema import EmbodiedRunConfig, PolicyModelConfig

    name, config, weights, _stats = import_lerobot(src, dtype=dtype, lazy=True)
    state = {}
    with progress_bar(progress, "convert") as bar:
        task = bar.add_task("convert", total=sum(t.numel() for t in weights.meta().values()), name="")
        for key in weights:
            bar.update(task, name=key)
            state[key] = weights[key].contiguous()
            bar.advance(task, state[key].numel())
    fields = to_dict(config)

    def differing(preset: str) -> dict:
        base = to_dict(POLICIES.get(name).presets[preset])
        return {k: v for k, v in fields.items() if base.get(k) != v}

    preset = min(POLICIES.get(name).presets, key=lambda p: len(differing(p)))
    model = PolicyModelConfig(policy=name, preset=preset, config=differing(preset))
    run = EmbodiedRunConfig(model=model, run_name=dst.name, output_dir=str(dst.parent))

    class WeightsOnly:  # the slice of an engine the checkpoint manager needs
        def save(self, directory: Path) -> None:
            dcp.save({"model": state}, checkpoint_id=str(directory))

    return CheckpointManager(dst / "checkpoints").save(0, WeightsOnly(), {"step": 0, "weights_only": True,
                                                                          "source": str(src)}, to_dict(run))


def _commands() -> dict[str, Command]:
    commands = {
        "train": Command("train a policy (default: the tiny Pi0.5 on the synthetic reach task, on CPU)",
                         _setup_train, _run_train),
        "convert": Command("convert a Loong checkpoint to a lerobot policy folder, or back (direction from SRC)",
                           _setup_convert, _run_convert),
    }

    commands.update(eval=EVAL_COMMAND, serve=SERVE_COMMAND)
    return commands


main = make_cli(
    prog="loong-embodied",
    description="Train vision-language-action policies (Pi0.5, GR00T N1.7, GR00T N1.6) on LeRobotDataset v3 with "
                "the fsdp engine, on CPU or GPUs; evaluate, serve and export them to LeRobot.",
    module="loong.embodied.cli",
    commands=_commands(),
    epilog=_presets_epilog,
)

if __name__ == "__main__":
    sys.exit(main())
