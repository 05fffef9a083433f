"""Test fixtures for Pi0.5 against lerobot 0.6.1 (test tree only): tiny configs, a seeded HF cache, lerobot patches.

lerobot's ``PI05Policy`` has no size knobs, so the oracle is shrunk by the research recipe
(``/work/shared/research/feasibility-modalities.md`` §3.3): ``modeling_pi05.get_gemma_config`` returns tiny Gemma
sizes and ``modeling_pi05.PaliGemmaForConditionalGenerationWithPiGemma`` is a subclass that shrinks SigLIP before
building. lerobot's processor loads the hard-coded tokenizer ``google/paligemma-3b-pt-224``; :func:`seed_hf_cache`
puts the tiny tokenizer there in a temporary hub cache (``HF_HUB_OFFLINE=1``, nothing is fetched).

:func:`lerobot_patches` also makes lerobot's *inference* path run under transformers 5.24: lerobot 0.6.1's
``pi_gemma.PiGemmaModel.forward`` calls ``create_causal_mask(..., cache_position=..., past_key_values=...)``, whose
5.24 signature has neither (the cache argument is named ``cache``, and ``cache_position`` is gone). The patch
replaces the name ``create_causal_mask`` inside ``lerobot.policies.pi_gemma`` only, by a wrapper that drops
``cache_position`` and passes ``past_key_values`` as ``cache``. Pi0.5 always hands it a ready 4-D mask, which
transformers returns unchanged, so the wrapper alters nothing else.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from loong.embodied.policies.pi05.config import PALIGEMMA_TOKENIZER, TINY_TOKENIZER, Pi05Config
from loong.embodied.policies.pi05.tokenizer import tiny_tokenizer

# the oracle's shapes: lerobot fixes the vocabulary (257152) and 8 query heads; the expert is narrower than the VLM
TINY_VLM = {"width": 64, "depth": 2, "mlp_dim": 128, "num_heads": 8, "num_kv_heads": 1, "head_dim": 8}
TINY_EXPERT = {"width": 32, "depth": 2, "mlp_dim": 64, "num_heads": 8, "num_kv_heads": 1, "head_dim": 8}
TINY_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
IMAGE_SIZE = 56  # 4 x 4 patches of 14
CAMERAS = ("observation.images.top", "observation.images.wrist")
STATE_DIM, ACTION_DIM = 3, 3


def parity_config(**changes: Any) -> Pi05Config:
    """The Loong config of the shrunk lerobot oracle."""
    config = Pi05Config(
        chunk_size=4, n_action_steps=4, max_state_dim=8, max_action_dim=8, num_inference_steps=3,
        image_size=IMAGE_SIZE, patch_size=14, vision_width=TINY_VISION["hidden_size"],
        vision_depth=TINY_VISION["num_hidden_layers"], vision_mlp_dim=TINY_VISION["intermediate_size"],
        vision_num_heads=TINY_VISION["num_attention_heads"], vocab_size=257152,
        vlm_width=TINY_VLM["width"], vlm_depth=TINY_VLM["depth"], vlm_mlp_dim=TINY_VLM["mlp_dim"],
        expert_width=TINY_EXPERT["width"], expert_mlp_dim=TINY_EXPERT["mlp_dim"], num_heads=8, num_kv_heads=1,
        head_dim=8, tokenizer_max_length=48, tokenizer=TINY_TOKENIZER)
    return config.replace(**changes) if changes else config


def features() -> dict[str, dict[str, Any]]:
    """LeRobot dataset features of the test batch (two cameras, a 3-D state and action)."""
    cam = {"dtype": "video", "shape": [48, 64, 3], "names": ["height", "width", "channels"]}
    return {CAMERAS[0]: dict(cam), CAMERAS[1]: dict(cam),
            "observation.state": {"dtype": "float32", "shape": [STATE_DIM], "names": ["a", "b", "c"]},
            "action": {"dtype": "float32", "shape": [ACTION_DIM], "names": ["a", "b", "c"]}}


def stats() -> dict[str, dict[str, np.ndarray]]:
    """Quantile statistics (as ``meta/stats.json`` loads) for the test features."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, lo, hi in (("observation.state", [-1.0, -2.0, 0.0], [1.0, 2.0, 3.0]),
                        ("action", [-0.5, -1.0, -2.0], [0.5, 1.5, 2.0])):
        lo_a, hi_a = np.array(lo), np.array(hi)
        out[key] = {"q01": lo_a, "q99": hi_a, "min": lo_a - 0.1, "max": hi_a + 0.1, "mean": (lo_a + hi_a) / 2,
                    "std": (hi_a - lo_a) / 4, "q10": lo_a * 0.8, "q50": (lo_a + hi_a) / 2, "q90": hi_a * 0.8}
    return out


def raw_batch(b: int = 2, seed: int = 0) -> dict[str, Any]:
    """A raw collate_vla batch: two cameras of different content (48x64, so they are resized with padding),
    states, actions with the last steps of sample 1 padded, tasks."""
    g = torch.Generator().manual_seed(seed)
    action = torch.rand(b, 4, ACTION_DIM, generator=g) * 2 - 1
    is_pad = torch.zeros(b, 4, dtype=torch.bool)
    is_pad[1, 2:] = True
    action[1, 2:] = action[1, 1]  # lerobot repeats the last action past the episode's end
    return {CAMERAS[0]: torch.rand(b, 3, 48, 64, generator=g),
            CAMERAS[1]: torch.rand(b, 3, 48, 64, generator=g) * 0.5,
            "observation.state": torch.rand(b, STATE_DIM, generator=g) * 3 - 1.5,
            "action": action, "action_is_pad": is_pad,
            "task": ["reach the red target", "reach the blue target\n"][:b] + ["reach_the green target"] * (b - 2)}


def seed_hf_cache(cache: Path, repo_id: str = PALIGEMMA_TOKENIZER) -> Path:
    """A hub cache folder in which ``repo_id`` resolves offline to the tiny tokenizer (plus a stub config)."""
    rev = "0" * 40
    base = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = base / "snapshots" / rev
    snapshot.mkdir(parents=True, exist_ok=True)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(rev)
    tiny_tokenizer().save_pretrained(str(snapshot))
    (snapshot / "config.json").write_text(json.dumps({"model_type": "paligemma"}))
    return cache


def _gemma_config(variant: str) -> Any:
    from lerobot.policies.pi05 import modeling_pi05 as m

    sizes = TINY_VLM if variant == "gemma_2b" else TINY_EXPERT
    return m.GemmaConfig(**sizes)


def _create_causal_mask_524(*args: Any, cache_position: Any = None, past_key_values: Any = None,
                            **kwargs: Any) -> Any:
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(*args, cache=past_key_values, **kwargs)


@contextlib.contextmanager
def lerobot_patches(hub_cache: Path) -> Iterator[None]:
    """Shrink lerobot's Pi0.5, seed the hub cache, and let lerobot's inference run under transformers 5.24."""
    import huggingface_hub.constants
    from lerobot.policies import pi_gemma
    from lerobot.policies.pi05 import modeling_pi05 as m

    base = m.PaliGemmaForConditionalGenerationWithPiGemma

    class TinyPaliGemma(base):  # type: ignore[misc, valid-type]
        def __init__(self, config: Any) -> None:
            for name, value in TINY_VISION.items():
                setattr(config.vision_config, name, value)
            config.vision_config.projection_dim = config.text_config.hidden_size
            super().__init__(config)

    seed_hf_cache(hub_cache)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(m, "get_gemma_config", _gemma_config)
        mp.setattr(m, "PaliGemmaForConditionalGenerationWithPiGemma", TinyPaliGemma)
        mp.setattr(pi_gemma, "create_causal_mask", _create_causal_mask_524)
        mp.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
        yield


def lerobot_config(**changes: Any) -> Any:
    """lerobot's ``PI05Config`` of the parity setup (use inside :func:`lerobot_patches`)."""
    from lerobot.configs import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config

    c = parity_config()
    inputs = {key: PolicyFeature(FeatureType.VISUAL, (3, 48, 64)) for key in CAMERAS}
    inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (STATE_DIM,))
    kwargs = dict(device="cpu", chunk_size=c.chunk_size, n_action_steps=c.n_action_steps,
                  max_state_dim=c.max_state_dim, max_action_dim=c.max_action_dim,
                  num_inference_steps=c.num_inference_steps, image_resolution=(IMAGE_SIZE, IMAGE_SIZE),
                  tokenizer_max_length=c.tokenizer_max_length, input_features=inputs,
                  output_features={"action": PolicyFeature(FeatureType.ACTION, (ACTION_DIM,))})
    kwargs.update(changes)
    return PI05Config(**kwargs)


def fixed_draws(policy: Any, noise: torch.Tensor, time: torch.Tensor) -> None:
    """Make a lerobot ``PI05Policy`` use ``noise`` / ``time`` instead of drawing them (instance attributes only)."""
    policy.model.sample_noise = lambda shape, device: noise.clone()
    policy.model.sample_time = lambda bsize, device: time.clone()


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|``."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


__all__ = ["CAMERAS", "fixed_draws", "features", "lerobot_config", "lerobot_patches", "max_rel_err",
           "parity_config", "raw_batch", "seed_hf_cache", "stats"]
