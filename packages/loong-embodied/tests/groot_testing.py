"""Fixtures for the GR00T N1.7 tests: lerobot's GrootPolicy built tiny and offline, and matching raw batches.

lerobot's GrootPolicy always calls ``GR00TN17.from_pretrained(base_model_path)`` and its processor loads the
hard-coded ``nvidia/Cosmos-Reason2-2B`` tokenizer / image processor, so (research recipe, feasibility §3.3/§6):

1. the tiny Qwen3-VL processor (:mod:`loong.embodied.policies.groot_n1_7.tiny_processor`) is seeded into a
   temporary HF cache under ``nvidia/Cosmos-Reason2-2B`` (``HF_HUB_OFFLINE=1``);
2. the tiny Qwen3-VL config is saved to a folder and a random tiny ``GR00TN17`` base checkpoint that names it is
   saved with ``save_pretrained``;
3. ``GrootConfig(base_model_path=<base>, ...)`` builds the policy; max dims 16 and chunk 8 avoid the values
   GrootConfig silently remaps (max_state_dim 64, max_action_dim 32, chunk 50).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from loong.embodied.policies.groot_n1_7.config import GrootN17Config, tiny
from loong.embodied.policies.groot_n1_7.tiny_processor import save_tiny_processor

STATE_DIM, ACTION_DIM = 6, 5
CAMERAS = ("observation.images.front", "observation.images.wrist")


def seed_hub_cache(hf_home: Path, repo_id: str, fill) -> Path:
    """Make ``repo_id`` resolve offline from ``hf_home``: ``fill(snapshot_dir)`` writes the files."""
    rev = "0" * 40
    base = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "snapshots" / rev).mkdir(parents=True, exist_ok=True)
    (base / "refs" / "main").write_text(rev)
    fill(base / "snapshots" / rev)
    return base / "snapshots" / rev


def lerobot_n17_config_kwargs(config: GrootN17Config, backbone_dir: Path) -> dict:
    """lerobot ``GR00TN17Config`` kwargs with the same shapes as the Loong ``config``."""
    return dict(
        model_name=str(backbone_dir), backbone_model_type="qwen", backbone_embedding_dim=config.backbone_embedding_dim,
        select_layer=config.select_layer, hidden_size=config.hidden_size,
        input_embedding_dim=config.input_embedding_dim, max_state_dim=config.max_state_dim,
        max_action_dim=config.max_action_dim, action_horizon=config.chunk_size, max_seq_len=config.max_seq_len,
        max_num_embodiments=config.num_embodiments, model_dtype="float32", dtype="float32",
        state_dropout_prob=config.state_dropout_prob, num_inference_timesteps=config.num_inference_steps,
        diffusion_model_cfg=dict(positional_embeddings=None, num_layers=config.dit_num_layers,
                                 num_attention_heads=config.dit_num_heads, attention_head_dim=config.dit_head_dim,
                                 norm_type="ada_norm", dropout=config.dit_dropout, final_dropout=True,
                                 output_dim=config.hidden_size, interleave_self_attention=True),
        vl_self_attention_cfg=dict(positional_embeddings=None, num_layers=config.vl_self_attention_layers,
                                   num_attention_heads=config.vl_self_attention_heads,
                                   attention_head_dim=config.vl_self_attention_head_dim,
                                   dropout=config.vl_self_attention_dropout, final_dropout=True))


def make_lerobot_env(root: Path, config: GrootN17Config | None = None) -> dict:
    """Seed the HF cache, write the tiny backbone config and base checkpoint under ``root``.

    Sets ``HF_HOME`` (and ``HF_HUB_OFFLINE=1``) for this process. Returns paths and the Loong config.
    """
    from lerobot.policies.groot.groot_n1_7 import GR00TN17, GR00TN17Config
    from transformers import Qwen3VLConfig

    config = config or tiny()
    hf_home = root / "hf_home"
    os.environ["HF_HOME"] = str(hf_home)
    os.environ["HF_HUB_OFFLINE"] = "1"
    import huggingface_hub.constants as hub_constants

    hub_constants.HF_HOME = str(hf_home)
    hub_constants.HF_HUB_CACHE = str(hf_home / "hub")
    hub_constants.HF_HUB_OFFLINE = True

    backbone_dir = root / "tiny_qwen3vl"
    Qwen3VLConfig(**config.backbone_dict()).save_pretrained(str(backbone_dir))

    def fill(snapshot: Path) -> None:
        save_tiny_processor(snapshot)
        (snapshot / "config.json").write_text((backbone_dir / "config.json").read_text())

    processor_dir = seed_hub_cache(hf_home, "nvidia/Cosmos-Reason2-2B", fill)
    base_dir = root / "tiny_groot_base"
    torch.manual_seed(0)
    GR00TN17(GR00TN17Config(**lerobot_n17_config_kwargs(config, backbone_dir)),
             load_backbone_weights=False).save_pretrained(str(base_dir))
    return {"hf_home": hf_home, "backbone_dir": backbone_dir, "base_dir": base_dir,
            "processor_dir": processor_dir, "config": config.replace(processor=str(processor_dir))}


def lerobot_groot_config(env: dict, **overrides):
    """lerobot ``GrootConfig`` for the tiny base (fp32, CPU, two cameras)."""
    from lerobot.configs import FeatureType, PolicyFeature
    from lerobot.policies.groot.configuration_groot import GrootConfig

    config: GrootN17Config = env["config"]
    features = {cam: PolicyFeature(type=FeatureType.VISUAL, shape=(3, 48, 64)) for cam in CAMERAS}
    features["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(STATE_DIM,))
    kwargs = dict(device="cpu", base_model_path=str(env["base_dir"]), max_state_dim=config.max_state_dim,
                  max_action_dim=config.max_action_dim, chunk_size=config.chunk_size,
                  n_action_steps=config.n_action_steps, tune_llm=config.tune_llm, tune_visual=config.tune_visual,
                  use_bf16=False, model_params_fp32=True, input_features=features,
                  output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM,))})
    kwargs.update(overrides)
    return GrootConfig(**kwargs)


def dataset_stats() -> dict[str, dict[str, torch.Tensor]]:
    """min/max (and mean/std) statistics of the synthetic batch's state and action, one constant dim each."""
    smin = torch.linspace(-2.0, -0.5, STATE_DIM)
    smax = torch.linspace(0.5, 3.0, STATE_DIM)
    smax[2] = smin[2]  # a constant feature: GR00T maps it to 0
    amin = torch.linspace(-1.0, -0.2, ACTION_DIM)
    amax = torch.linspace(0.3, 2.0, ACTION_DIM)
    return {
        "observation.state": {"min": smin, "max": smax, "mean": (smin + smax) / 2, "std": torch.ones(STATE_DIM)},
        "action": {"min": amin, "max": amax, "mean": (amin + amax) / 2, "std": torch.ones(ACTION_DIM)},
    }


def raw_batch(batch_size: int = 2, chunk: int = 8, seed: int = 0) -> dict:
    """A ``collate_vla``-shaped raw batch: two 48x64 cameras, state, an action chunk with padded tail steps."""
    g = torch.Generator().manual_seed(seed)
    batch = {cam: torch.rand(batch_size, 3, 48, 64, generator=g) for cam in CAMERAS}
    batch["observation.state"] = torch.randn(batch_size, STATE_DIM, generator=g) * 1.5
    batch["action"] = torch.randn(batch_size, chunk, ACTION_DIM, generator=g)
    pad = torch.zeros(batch_size, chunk, dtype=torch.bool)
    pad[0, -2:] = True
    batch["action_is_pad"] = pad
    batch["task"] = ["Pick up the red cube!", "push the blue block"][:batch_size] + ["move"] * max(0, batch_size - 2)
    batch["index"] = torch.arange(batch_size)
    return batch


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))


__all__ = ["ACTION_DIM", "CAMERAS", "STATE_DIM", "dataset_stats", "lerobot_groot_config", "make_lerobot_env",
           "raw_batch", "seed_hub_cache"]
