"""Under the fsdp engine's bf16 mixed precision the Wan model gets its timesteps in fp32 (bf16 holds 999.3 as
1000, 250.5 as 250: training would see other timesteps than diffusers' pipelines feed), and the rest of its inputs
in bf16. FSDP2 over a world of one gloo process, as the engine shards it (``wrap.shard``)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from loong.core.engines.fsdp.wrap import shard
from loong.diffusion.models.wan import WanTransformer
from loong.diffusion.models.wan.config import wan_preset
from loong.diffusion.task import ShardPrediction, WanTask


@pytest.fixture
def world_of_one(tmp_path):  # noqa: ANN001, ANN201
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.mark.parametrize("cast_root_inputs", [WanTask.cast_root_inputs, True], ids=["wan_task", "fsdp_default"])
def test_timesteps_reach_the_model_in_fp32(world_of_one, cast_root_inputs: bool) -> None:  # noqa: ANN001
    wan = wan_preset("tiny")
    model = ShardPrediction(WanTransformer(wan))
    layout = types.SimpleNamespace(config=types.SimpleNamespace(fsdp="full", fsdp_cpu_offload=False),
                                   shard_mesh=world_of_one, dp_cp_group=None)
    model = shard(model, list(model.wan.blocks), layout, torch.bfloat16, reduce_in_bf16=False, pin_memory=False,
                  cast_root_inputs=cast_root_inputs)
    seen: dict[str, torch.Tensor] = {}
    model.wan.condition.register_forward_pre_hook(lambda _m, args: seen.update(timestep=args[0], text=args[1]))
    latents, text = torch.randn(1, 16, 2, 4, 4), torch.randn(1, 5, wan.text_dim)
    model(latents, torch.tensor([999.3]), text)
    assert seen["text"].dtype == torch.bfloat16
    assert seen["timestep"].dtype == torch.float32
    if cast_root_inputs:  # what FSDP2 does to every float input by default (999.3 → bf16 1000), and why Wan opts out
        assert float(seen["timestep"]) == 1000.0
    else:
        assert float(seen["timestep"]) == pytest.approx(999.3)
