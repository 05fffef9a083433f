"""loong-embodied's tests never touch the network: the Hugging Face Hub is off for lerobot and its dependencies."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
