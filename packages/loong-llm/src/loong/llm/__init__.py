"""Loong LLM: dense LLaMA/Qwen families, their Hugging Face mappings, text data and the `loong-llm` command."""

from importlib.metadata import version as _package_version

__version__ = _package_version("loong-llm")  # pyproject.toml's `version`, the one source
