"""Loong LLM: dense LLaMA/Qwen families, their Hugging Face mappings, text data and the `loong-llm` command."""

__version__ = "0.1.0.dev0"
