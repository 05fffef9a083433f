"""The ``fsdp`` engine: torch-native FSDP2 / HSDP / DDP over a ``DeviceMesh``, for any plain ``nn.Module``.

Needs nothing beyond torch (no megatron-core): diffusion transformers, VLA policies and models taken as they are
from ``transformers`` / ``diffusers`` train here.

- :mod:`.task`: :class:`~.task.FSDPTask`, what the engine needs from a task (``build_model``, ``loss``);
- :mod:`.mesh`: the ``(dp_replicate, dp_shard, cp)`` mesh from ``parallel.*`` (:class:`~.mesh.FSDPLayout`);
- :mod:`.wrap`: activation checkpointing, ``torch.compile`` and sharding applied per block, from outside;
- :mod:`.schedule`: AdamW parameter groups and the warm-up + decay schedule (megatron-core's formulas);
- :mod:`.checkpoint`: torch DCP save/load (sharded, layout-independent, async);
- :mod:`.engine`: :class:`~.engine.FSDPEngine`.
"""
