"""GR00T N1.7's training step is capture-safe (``cuda_graph_safe``; one CPU process, fp32, the tiny preset).

- The device step (``policy(inputs)``: the loss forward and its backward, on inputs the processor made and
  :meth:`~loong.embodied.task.VLATask.prepare` completed) calls no op that, on a GPU, makes the host wait for the
  device (``item``, ``nonzero``, boolean indexing, ``repeat_interleave`` without ``output_size``, ...) and none
  that makes a tensor from host data (``torch.tensor``: a host-to-device copy): a dispatch mode records them.
- What made it sync is precomputed by the processor (``groot_n1_7/precompute.py``); the precomputed tensors equal
  transformers' own computations (``compute_3d_position_ids``, the whole ``Qwen3VLVisionModel.forward``), and the
  loss and every gradient equal, bit for bit, those of the former forward (transformers' M-RoPE, its vision tower
  computing its own indices, ``masked_scatter`` and the boolean-mask deepstack), on a batch whose samples have
  their image tokens at different positions (left padding of prompts of different lengths).
- The flow times are drawn on the host by ``host_draws`` (``inputs[FLOW_TIME_KEY]``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from loong.core.errors import LoongError
from loong.embodied.policies.base import FLOW_TIME_KEY
from loong.embodied.policies.groot_n1_7 import SPEC, GrootN17Processor
from loong.embodied.policies.groot_n1_7 import precompute as pre
from loong.embodied.task import SEED_KEY, VLATask

sys.path.insert(0, str(Path(__file__).parent))  # the shared fixtures module beside this file
import groot_testing as gt  # noqa: E402
from capture_testing import check_host_drawn_times, loss_and_grads, record_step  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    config = SPEC.presets["tiny"]
    torch.manual_seed(0)
    policy = SPEC.policy_class(config).train()
    processor = GrootN17Processor(config, stats=gt.dataset_stats(), camera_keys=gt.CAMERAS)
    return policy, processor


def _raw(b: int = 3, seed: int = 1) -> dict:
    raw = gt.raw_batch(batch_size=b, seed=seed)
    raw["task"] = ["Pick up the red cube and place it in the box!", "push", "open the drawer"][:b]
    return raw


def _without_precomputed(inputs: dict) -> dict:
    return {k: v for k, v in inputs.items() if k not in pre.PRECOMPUTED_KEYS}


def test_groot_n1_7_is_declared_capture_safe():
    assert SPEC.policy_class.cuda_graph_safe


def test_the_training_step_never_syncs_the_device_nor_copies_from_the_host(tiny):
    policy, processor = tiny
    batch = processor(_raw())
    batch[SEED_KEY] = 11
    inputs = VLATask.prepare(None, policy, batch)  # type: ignore[arg-type]  # prepare reads no task state
    assert inputs[FLOW_TIME_KEY].shape == (3,) and inputs[FLOW_TIME_KEY].dtype == torch.float32
    seen = record_step(policy, inputs)
    assert seen == [], "device syncs / host data in the step:\n" + "\n".join(sorted(set(seen)))


def test_the_recorder_sees_the_former_step(tiny):
    """The control: the inputs without the precomputed tensors and the host-drawn times take the direct callers'
    path (indices computed from ``input_ids`` / ``image_grid_thw``, the Beta draw in the loss), which syncs."""
    policy, processor = tiny
    seen = record_step(policy, _without_precomputed(processor(_raw())))
    assert any("_local_scalar_dense" in s for s in seen)  # .tolist() / int() reads
    assert any("aten.lift_fresh" in s for s in seen)  # the Beta distribution's host tensors
    assert any("aten.nonzero" in s for s in seen)  # the image tokens' positions


def test_precomputed_tensors_equal_transformers_own(tiny):
    policy, processor = tiny
    inputs = processor(_raw())
    ids, grid = inputs["input_ids"], inputs["image_grid_thw"]
    s = ids.shape[1]
    image_rows = [set((inputs[pre.IMAGE_INDEX_KEY][inputs[pre.IMAGE_INDEX_KEY] // s == i] % s).tolist())
                  for i in range(ids.shape[0])]
    assert image_rows[0] != image_rows[1]  # left padding: the samples' image tokens sit at different positions
    backbone = policy.backbone
    theirs = backbone.compute_3d_position_ids(input_ids=ids, inputs_embeds=None, image_grid_thw=grid,
                                              attention_mask=inputs["attention_mask"],
                                              mm_token_type_ids=inputs["mm_token_type_ids"])
    assert torch.equal(inputs[pre.MROPE_KEY], theirs)
    assert torch.equal(inputs[pre.IMAGE_INDEX_KEY], (ids == policy.image_token_id).flatten().nonzero().flatten())
    visual = backbone.visual
    pixels = inputs["pixel_values"]
    own = visual(pixels, grid_thw=grid, return_dict=True)
    given = visual(pixels, grid_thw=grid, return_dict=True, cu_seqlens=inputs[pre.CU_SEQLENS_KEY],
                   max_seqlen=pre.max_image_patches(pixels, grid), position_ids=inputs[pre.VISION_POSITION_KEY],
                   interp_indices=inputs[pre.INTERP_INDEX_KEY], interp_weights=inputs[pre.INTERP_WEIGHT_KEY])
    assert torch.equal(own.pooler_output, given.pooler_output)
    assert len(own.deepstack_features) == len(given.deepstack_features) == 2
    for a, b in zip(own.deepstack_features, given.deepstack_features, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("grid", [[[1, 4, 6], [1, 2, 4], [1, 4, 4]], [[1, 8, 4], [1, 4, 4]]], ids=["mixed", "tall"])
def test_the_vision_indices_of_images_of_different_sizes_equal_the_towers_own(tiny, grid):
    """Direct callers may pass images of several sizes: :func:`precompute`'s vision tensors still give the vision
    tower's own output (the per-image attention then reads its lengths from ``cu_seqlens``)."""
    policy, _ = tiny
    visual = policy.backbone.visual
    grid_t = torch.tensor(grid)
    c = visual.config
    pixels = torch.randn(int(grid_t.prod(-1).sum()), c.in_channels * c.temporal_patch_size * c.patch_size**2)
    geometry = policy.geometry
    start, end = 3, 4  # the tiny vocabulary's <|vision_start|> / <|vision_end|>
    ids = torch.tensor([[7] + sum(([start] + [geometry.image_token_id] * (t * h * w // 4) + [end]
                                   for t, h, w in grid), [])])
    found = pre.precompute(ids, None, None, grid_t, geometry)
    own = visual(pixels, grid_thw=grid_t, return_dict=True)
    given = visual(pixels, grid_thw=grid_t, return_dict=True, cu_seqlens=found[pre.CU_SEQLENS_KEY],
                   max_seqlen=pre.max_image_patches(pixels, grid_t, found[pre.CU_SEQLENS_KEY]),
                   position_ids=found[pre.VISION_POSITION_KEY], interp_indices=found[pre.INTERP_INDEX_KEY],
                   interp_weights=found[pre.INTERP_WEIGHT_KEY])
    assert torch.equal(own.pooler_output, given.pooler_output)
    mm = pre.token_types(ids, geometry)
    theirs = policy.backbone.compute_3d_position_ids(input_ids=ids, inputs_embeds=None, image_grid_thw=grid_t,
                                                     attention_mask=torch.ones_like(ids), mm_token_type_ids=mm)
    assert torch.equal(found[pre.MROPE_KEY], theirs)


def former_vl_features(policy, inputs):  # noqa: ANN001, ANN201
    """``GrootN17Policy.vl_features`` as it was: transformers computes every index (M-RoPE, the vision tower's),
    the features go in by ``masked_scatter`` and deepstack by a boolean-mask update."""
    backbone = policy.backbone
    lm, visual = backbone.language_model, backbone.visual
    ids, attention_mask, grid = inputs["input_ids"], inputs["attention_mask"], inputs["image_grid_thw"]
    embeds = lm.embed_tokens(ids)
    vision = visual(inputs["pixel_values"].type(visual.dtype), grid_thw=grid, return_dict=True)
    image_mask = ids == policy.image_token_id
    embeds = embeds.masked_scatter(image_mask.unsqueeze(-1), vision.pooler_output.to(embeds.dtype))
    positions = backbone.compute_3d_position_ids(input_ids=ids, inputs_embeds=None, image_grid_thw=grid,
                                                 attention_mask=attention_mask,
                                                 mm_token_type_ids=inputs["mm_token_type_ids"])
    from loong.embodied.policies.groot_n1_7.model import causal_padding_mask

    mask = causal_padding_mask(attention_mask, embeds.dtype)
    rope = lm.rotary_emb(embeds, positions)
    hidden, last = embeds, len(lm.layers) - 1
    for i, layer in enumerate(lm.layers):
        hidden = layer(hidden, attention_mask=mask, position_ids=positions[0], position_embeddings=rope)
        if i < len(vision.deepstack_features) and i < last:
            hidden = hidden.clone()
            hidden[image_mask] = hidden[image_mask] + vision.deepstack_features[i].to(hidden.dtype)
    return hidden, attention_mask == 1, image_mask


def test_loss_and_gradients_equal_the_former_forward_bit_for_bit(tiny, monkeypatch):
    policy, processor = tiny
    inputs = processor(_raw())
    c = policy.config
    noise = torch.randn(3, c.chunk_size, c.max_action_dim, generator=torch.Generator().manual_seed(2))
    time = policy.action_head.sample_time(3)
    ours, ours_grads = loss_and_grads(policy, inputs, noise, time)
    direct, direct_grads = loss_and_grads(policy, _without_precomputed(inputs), noise, time)
    with monkeypatch.context() as m:
        m.setattr(policy, "vl_features", lambda x: former_vl_features(policy, x))
        former, former_grads = loss_and_grads(policy, _without_precomputed(inputs), noise, time)
    assert torch.equal(ours, former) and torch.equal(direct, former)
    assert set(ours_grads) == set(former_grads) == set(direct_grads)
    assert any(n.startswith("backbone.visual.") for n in ours_grads)
    assert any(n.startswith("backbone.language_model.") for n in ours_grads)
    for name, g in former_grads.items():
        assert torch.equal(ours_grads[name], g), name
        assert torch.equal(direct_grads[name], g), name


def test_host_drawn_times_equal_times_passed_explicitly(tiny):
    policy, processor = tiny
    inputs = processor(_raw())
    check_host_drawn_times(policy, inputs)


def test_the_processor_refuses_what_the_step_no_longer_checks(tiny):
    policy, processor = tiny
    raw = _raw()
    raw["embodiment_id"] = torch.tensor([0, policy.config.num_embodiments, 1])
    with pytest.raises(LoongError, match="embodiment_id must be in"):
        processor(raw)
    inputs = processor(_raw())
    grid = inputs["image_grid_thw"].clone()
    grid[0, 1] = 2  # an image whose grid makes fewer features than its image tokens
    with pytest.raises(LoongError, match="image_grid_thw"):
        pre.precompute(inputs["input_ids"], inputs["attention_mask"], inputs["mm_token_type_ids"], grid,
                       processor.geometry)
    with pytest.raises(LoongError, match="different sizes"):
        pre.check_one_image_size(grid, "groot_n1_7 processor")
    # the direct callers' path keeps the policy's own checks
    direct = _without_precomputed(inputs)
    direct["embodiment_id"] = torch.tensor([0, -1, 1])
    with pytest.raises(LoongError, match="embodiment_id"):
        policy(direct, time=torch.full((3,), 0.5))
