"""Supervised fine-tuning on chat data: formats, chat templates, packing and the ``sft`` task."""
