"""loong-llm's plugin entry point: its tasks and its packaged config groups (imports nothing heavy)."""

from loong.core.registry import CONFIG_DIRS, RUN_CONFIGS, TASKS, RunConfigSource

TASKS.add_lazy("llm.pretrain", "loong.llm.pretrain:PretrainTask")
TASKS.add_lazy("pretrain", "loong.llm.pretrain:PretrainTask")
TASKS.add_lazy("llm.sft", "loong.llm.sft.task:SFTTask")
TASKS.add_lazy("sft", "loong.llm.sft.task:SFTTask")
CONFIG_DIRS.add("llm", "pkg://loong.llm.configs")
RUN_CONFIGS.add("loong-llm", RunConfigSource("loong.llm.configs", "pretrain", "loong.llm.schema:LLMRunConfig"))
