"""The VLM data side: conversations with images and videos → packed, tokenised micro-batches.

:mod:`.conversations` (JSONL readers), :mod:`.media` (probe and decode), :mod:`.templates` and
:mod:`.processors` (chat templates, HF processors from local folders, the tiny processor), :mod:`.encode`
(one conversation → tokens, mask, pixels), :mod:`.rope_index` (M-RoPE / 1-D positions), :mod:`.packing`,
:mod:`.dataset` (the Dataset, collate and DataLoader; its docstring lists the micro-batch keys) and
:mod:`.synthetic` (the default shapes-and-captions set).
"""
