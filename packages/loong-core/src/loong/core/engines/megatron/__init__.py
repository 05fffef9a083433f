"""The ``megatron`` engine: megatron-core models, DDP, (distributed) optimiser and pipeline schedules.

Everything in loong-core that imports megatron-core lives in this package (and in the CPU accelerator's
adaptations, ``loong.core.accelerators.megatron_cpu``); it needs the ``loong-core[megatron]`` extra.

- :mod:`.engine`: :class:`~.engine.MegatronEngine`;
- :mod:`.task`: :class:`~.task.MegatronTask`, what the engine needs from a task;
- :mod:`.layout`: megatron-core's process groups (:class:`~.layout.MegatronLayout`, ``world``);
- :mod:`.state`: whole tensors in and out of a model at any TP/PP/EP layout;
- :mod:`.optimizer_state`: the optimiser's state keyed by the model's sharded keys (reshards freely);
- :mod:`.context_parallel`: the zigzag split and all-gather causal attention of the LLM's CP;
- :mod:`.fp8`: FP8 execution of megatron's linear layers.
"""
