"""A ``loong-embodied train`` worker with the test-only toy policy registered: ``python -m torch.distributed.run
... toy_train.py KEY=VALUE ...`` (the CLI's own relaunch would start workers that do not know the toy policy)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

import toy_policy  # noqa: E402,F401  (registers "toy")

from loong.embodied.cli import main  # noqa: E402

sys.exit(main(["train", "model.policy=toy", *sys.argv[1:]]))
