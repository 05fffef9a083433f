"""loong-llm's plugin entry point: registers its task and its packaged config groups."""

from loong.core.registry import CONFIG_DIRS
from loong.llm import pretrain  # noqa: F401  (registers the llm.pretrain task)

CONFIG_DIRS.add("llm", "pkg://loong.llm.configs")
