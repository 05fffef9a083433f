"""loong-llm's plugin entry point: its task and its packaged config groups (imports nothing heavy)."""

from loong.core.registry import CONFIG_DIRS, TASKS

TASKS.add_lazy("llm.pretrain", "loong.llm.pretrain:PretrainTask")
CONFIG_DIRS.add("llm", "pkg://loong.llm.configs")
