"""Fixtures of the Wan tests: tiny random diffusers ``WanTransformer3DModel`` s built in-process (no downloads) with
the same weights copied into Loong's model through the mapping, and the helpers of ``wan_testing.py``."""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))  # test modules cannot import conftest by name; they use wan_testing

import wan_testing  # noqa: E402


@pytest.fixture(scope="session")
def wan() -> types.ModuleType:
    """The helpers of ``wan_testing.py``."""
    return wan_testing


@pytest.fixture(scope="session")
def wan_pair() -> Callable:
    """``wan_pair(variant)``: ``(diffusers model, Loong model, config)`` with equal random weights, fp32, eval
    mode; built once per variant for the whole session."""
    cache: dict[str, tuple] = {}

    def build(variant: str) -> tuple:
        if variant not in cache:
            from diffusers import WanTransformer3DModel

            from loong.diffusion.models.wan import WanTransformer, config_to_diffusers, from_diffusers

            config = wan_testing.tiny_config(variant)
            torch.manual_seed(0)
            fields = {k: v for k, v in config_to_diffusers(config).items() if not k.startswith("_")}
            reference = WanTransformer3DModel(**fields).eval()
            wan_testing.perturb(reference, seed=2)
            ours = WanTransformer(config).eval()
            ours.load_state_dict(from_diffusers(reference.state_dict()), strict=True)
            cache[variant] = (reference, ours, config)
        return cache[variant]

    return build
