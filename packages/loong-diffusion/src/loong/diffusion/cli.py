"""``loong-diffusion``: train Wan video diffusion transformers (flow matching) on the fsdp engine."""

from __future__ import annotations

import argparse
import sys

from loong.core.cli import Command, make_cli, run_train

CONFIG_MODULE = "loong.diffusion.configs"
CONFIG_NAME = "train"


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
        "  train.{steps,global_batch_size,micro_batch_size,lr,...,timestep_sampling,logit_mean,logit_std,",
        "  timestep_shift}, parallel.{fsdp,cp_ulysses,cp_ring}, output_dir, run_name",
    ]
    return "\n".join(lines)


def _setup_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides")


def _run_train(args: argparse.Namespace) -> int:
    from loong.diffusion.schema import DiffusionRunConfig

    return run_train(CONFIG_MODULE, CONFIG_NAME, args.overrides, DiffusionRunConfig, export_label="hf/ (diffusers)")


main = make_cli(
    prog="loong-diffusion",
    description="Train Wan 2.1 / 2.2 video diffusion transformers (flow matching) on the fsdp engine, on CPU or GPUs.",
    module="loong.diffusion.cli",
    commands={
        "train": Command("train a model (default: the tiny Wan on synthetic moving shapes, on CPU)",
                         _setup_train, _run_train),
    },
    epilog=_presets_epilog,
)

if __name__ == "__main__":
    sys.exit(main())
