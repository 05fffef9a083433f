"""loong-embodied's plugin entry point: its task and its run config (imports nothing heavy).

Its config groups are not added to ``CONFIG_DIRS``: ``loong-embodied`` composes from its own config module, and a
shared group would list the policy presets under the other modalities' ``--help``.
"""

from loong.core.registry import RUN_CONFIGS, TASKS, RunConfigSource

TASKS.add_lazy("embodied.vla", "loong.embodied.task:VLATask")
RUN_CONFIGS.add("loong-embodied", RunConfigSource("loong.embodied.configs", "train",
                                                  "loong.embodied.schema:EmbodiedRunConfig"))
