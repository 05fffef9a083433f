"""loong-diffusion's plugin entry point: its task (imports nothing heavy).

Its config groups are not added to ``CONFIG_DIRS``: ``loong-diffusion`` composes from its own config module, and a
shared ``model`` group would list the Wan presets under ``loong-llm train --help`` (and the LLM presets here).
"""

from loong.core.registry import RUN_CONFIGS, TASKS, RunConfigSource

TASKS.add_lazy("diffusion.wan", "loong.diffusion.task:WanTask")
RUN_CONFIGS.add("loong-diffusion", RunConfigSource("loong.diffusion.configs", "train",
                                                   "loong.diffusion.schema:DiffusionRunConfig"))
