"""loong-vlm's plugin entry point: its task (imports nothing heavy).

Its config groups are not added to ``CONFIG_DIRS``: ``loong-vlm`` composes from its own config module (as
loong-diffusion does), so its ``model`` presets do not appear under ``loong-llm train --help``.
"""

from loong.core.registry import RUN_CONFIGS, TASKS, RunConfigSource

TASKS.add_lazy("vlm.sft", "loong.vlm.task:VLMTask")
RUN_CONFIGS.add("loong-vlm", RunConfigSource("loong.vlm.configs", "train", "loong.vlm.schema:VLMRunConfig"))
