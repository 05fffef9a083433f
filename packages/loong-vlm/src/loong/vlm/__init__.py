"""Loong VLM: vision encoders, projectors and VLM assembly over loong-llm foundations."""

__version__ = "0.1.0.dev0"
