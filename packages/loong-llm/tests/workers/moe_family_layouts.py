"""Qwen3-MoE's and DeepSeek-V3's layout checks in one 2-process gloo launch, so CI starts the processes (and imports
megatron-core) once for both: ``torchrun --nproc-per-node 2 moe_family_layouts.py MOE_HF DENSE_HF DSV3_HF OUT_DIR``.

Each part is its own worker's ``run`` (``moe_layouts.py``, ``deepseek_layouts.py``), writing ``qwen3_moe.json`` and
``deepseek_v3.json`` into OUT_DIR; each also runs alone as a script.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import deepseek_layouts  # noqa: E402
import moe_layouts  # noqa: E402


def main() -> None:
    moe_hf, dense_hf, dsv3_hf, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    moe_layouts.run(moe_hf, out / "qwen3_moe.json", dense_hf)
    deepseek_layouts.run(dsv3_hf, out / "deepseek_v3.json")


if __name__ == "__main__":
    main()
