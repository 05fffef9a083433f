"""GR00T N1.6's training step is capture-safe (``cuda_graph_safe``; one CPU process, fp32, tiny configs).

- The device step (``policy(inputs)``: the loss forward and its backward, on inputs the processor made and
  :meth:`~loong.embodied.task.VLATask.prepare` completed) calls no op that, on a GPU, makes the host wait for the
  device (``item``, ``nonzero``, boolean indexing, ``masked_scatter``'s backward, ...) and none that makes a tensor
  from host data (``torch.tensor``: a host-to-device copy): a dispatch mode records them.
- What made it sync is precomputed by the processor (``groot_n1_6/precompute.py``): the image tokens' flat
  positions, and the SigLIP2 position table's resize as a matrix, which equals transformers' own resize bit for
  bit (numbers and the table's gradient). The loss and every gradient equal, bit for bit, those of the former
  forward (kept below: transformers' ``Siglip2VisionModel`` with ``spatial_shapes``, ``masked_scatter``,
  ``Qwen3Model`` building its own mask) on batches whose samples have their image tokens at different positions,
  at the tiny image size and at one whose patch grid differs from the position table's.
- The flow times are drawn on the host by ``host_draws`` (``inputs[FLOW_TIME_KEY]``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from loong.core.errors import LoongError
from loong.embodied.policies.base import FLOW_TIME_KEY
from loong.embodied.policies.groot_n1_6 import SPEC, GrootN16Policy, GrootN16Processor
from loong.embodied.policies.groot_n1_6 import precompute as pre
from loong.embodied.policies.groot_n1_6.eagle import patchify, pixel_shuffle
from loong.embodied.task import SEED_KEY, VLATask

sys.path.insert(0, str(Path(__file__).parent))  # the shared fixtures module beside this file
import groot16_testing as gt  # noqa: E402
from capture_testing import check_host_drawn_times, loss_and_grads, record_step  # noqa: E402

CAMERAS = [gt.CAMERA, gt.WRIST]
#: the tiny image size (a 4x4 patch grid = the position table) and one whose 6x4 grid makes the resize real
IMAGE_SIZES = {"tiny": (16, 16), "resized": (24, 16)}


def _setup(image_size: tuple[int, int], **changes) -> tuple[GrootN16Policy, GrootN16Processor]:  # noqa: ANN003
    # everything trainable, so that every gradient of the backbone is compared
    config = gt.tiny_config(image_size=image_size, tune_llm=True, tune_visual=True, **changes)
    torch.manual_seed(0)
    policy = GrootN16Policy(config).train()
    with torch.no_grad():  # non-trivial norms and biases, so a swapped or skipped one shows
        for name, param in policy.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    processor = GrootN16Processor(config, features=gt.features(), stats=gt.stats(), camera_keys=CAMERAS)
    return policy, processor


@pytest.fixture(scope="module", params=sorted(IMAGE_SIZES))
def tiny(request):  # noqa: ANN001, ANN201
    return _setup(IMAGE_SIZES[request.param])


def _raw(config, b: int = 3, seed: int = 1) -> dict:  # noqa: ANN001
    raw = gt.raw_batch(config.chunk_size, b=b, seed=seed)
    # prompts of different lengths: left padding puts each sample's image tokens elsewhere
    raw["task"] = ["reach the red target", "reach", "Reach the blue target, then the green target!"][:b]
    return raw


def _right_padded(inputs: dict, row: int, config) -> dict:  # noqa: ANN001
    """``inputs`` with sample ``row`` right-padded instead of left-padded: its image tokens move (the processor's
    left padding keeps them at one place, the text coming before the images), and its index is recomputed."""
    out = dict(inputs)
    ids, mask = inputs["input_ids"].clone(), inputs["attention_mask"].clone()
    pad = int((mask[row] == 0).sum())
    assert pad > 0
    ids[row], mask[row] = ids[row].roll(-pad), mask[row].roll(-pad)
    out["input_ids"], out["attention_mask"] = ids, mask
    out[pre.IMAGE_INDEX_KEY] = pre.image_token_index(ids, config.image_token_id,
                                                     len(CAMERAS) * config.tokens_per_image)
    return out


def _without_precomputed(inputs: dict) -> dict:
    return {k: v for k, v in inputs.items() if k not in pre.PRECOMPUTED_KEYS}


def _prepared(policy, processor, seed: int = 11) -> dict:  # noqa: ANN001
    batch = processor(_raw(policy.config))
    batch[SEED_KEY] = seed
    return VLATask.prepare(None, policy, batch)  # type: ignore[arg-type]  # prepare reads no task state


def test_groot_n1_6_is_declared_capture_safe() -> None:
    assert SPEC.policy_class.cuda_graph_safe


def test_the_training_step_never_syncs_the_device_nor_copies_from_the_host(tiny) -> None:  # noqa: ANN001
    policy, processor = tiny
    inputs = _prepared(policy, processor)
    assert inputs[FLOW_TIME_KEY].shape == (3,) and inputs[FLOW_TIME_KEY].dtype == torch.float32
    seen = record_step(policy, inputs)
    assert seen == [], "device syncs / host data in the step:\n" + "\n".join(sorted(set(seen)))


def test_the_step_with_state_dropout_never_syncs_either() -> None:
    """N1.6's ``mask_token`` state dropout (off in the published config) draws and mixes on the device."""
    policy, processor = _setup(IMAGE_SIZES["tiny"], state_dropout_prob=0.5)
    seen = record_step(policy, _prepared(policy, processor))
    assert seen == [], "\n".join(sorted(set(seen)))


def test_the_recorder_sees_the_former_step(tiny) -> None:  # noqa: ANN001
    """The control: inputs without the precomputed tensors and the host-drawn times take the direct callers' path
    (the image tokens found and counted from ``input_ids``, the resize matrix made on the host, the Beta draw in
    the loss), which syncs and copies."""
    policy, processor = tiny
    seen = record_step(policy, _without_precomputed(processor(_raw(policy.config))))
    assert any("_local_scalar_dense" in s for s in seen)  # the image-token count read
    assert any("aten.lift_fresh" in s for s in seen)  # host tensors (the Beta distribution's, the resize matrix)
    assert any("aten.nonzero" in s for s in seen)  # the image tokens' positions


@pytest.mark.parametrize("grid", [(4, 4), (2, 6), (6, 3), (6, 4), (8, 8)])
def test_the_resize_matrix_is_transformers_own_resize_bit_for_bit(grid: tuple[int, int]) -> None:
    """The position embeddings and the table's gradient equal those of transformers'
    ``Siglip2VisionEmbeddings.resize_positional_embeddings`` (what the former step ran)."""
    from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionEmbeddings

    side, dim, n = 4, 32, 3
    torch.manual_seed(2)
    table = torch.randn(side * side, dim, requires_grad=True)
    shapes = torch.tensor([list(grid)] * n)
    theirs = Siglip2VisionEmbeddings.resize_positional_embeddings(table.reshape(side, side, dim), shapes,
                                                                   max_length=grid[0] * grid[1])
    weights = pre.position_resize_weights(grid, side * side)
    assert weights.shape == (grid[0] * grid[1], side * side) and weights.dtype == torch.float32
    ours = pre.resized_positions(table, weights, n)
    assert torch.equal(ours, theirs)
    upstream = torch.randn(theirs.shape)
    (g_theirs,) = torch.autograd.grad(theirs, table, upstream)
    (g_ours,) = torch.autograd.grad(ours, table, upstream)
    assert torch.equal(g_ours, g_theirs)
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[0]))  # taps of an average
    if grid == (side, side):  # the table's own grid: the resize keeps it
        torch.testing.assert_close(ours[0], table.detach())


def test_precomputed_tensors_of_the_processor(tiny) -> None:  # noqa: ANN001
    policy, processor = tiny
    c = policy.config
    inputs = processor(_raw(c))
    ids, s = inputs["input_ids"], inputs["input_ids"].shape[1]
    index = inputs[pre.IMAGE_INDEX_KEY]
    assert torch.equal(index, (ids == c.image_token_id).flatten().nonzero().flatten())
    assert index.shape == (3 * len(CAMERAS) * c.tokens_per_image,)
    grid = pre.patch_grid(c.image_size, c.patch_size)
    assert torch.equal(inputs[pre.POS_WEIGHT_KEY], pre.position_resize_weights(grid, c.vision_num_patches))
    # the causal padding mask is the one Qwen3Model builds for SDPA from the 2D mask
    from transformers.masking_utils import create_causal_mask

    lm = policy.backbone.language_model
    embeds = lm.embed_tokens(ids)
    theirs = create_causal_mask(config=lm.config, inputs_embeds=embeds, attention_mask=inputs["attention_mask"],
                                cache=None, position_ids=torch.arange(s)[None])
    assert torch.equal(pre.causal_padding_mask(inputs["attention_mask"]), theirs)


def former_backbone(backbone, input_ids: torch.Tensor, attention_mask: torch.Tensor,  # noqa: ANN001
                    pixel_values: torch.Tensor, **_unused) -> torch.Tensor:  # noqa: ANN003
    """``EagleBackbone.forward`` as it was: transformers' SigLIP2 tower given ``spatial_shapes`` (its own
    position resize), the image-token count checked by a read, ``masked_scatter``, ``Qwen3Model``'s own mask."""
    c = backbone.config
    b, cams = pixel_values.shape[:2]
    images = pixel_values.flatten(0, 1)
    n, _, h, w = images.shape
    grid = (h // c.patch_size, w // c.patch_size)
    patches = patchify(images, c.patch_size).to(backbone.vision_model.embeddings.patch_embedding.weight.dtype)
    spatial_shapes = torch.tensor([grid] * n, dtype=torch.long, device=images.device)
    mask = torch.ones(patches.shape[:2], dtype=torch.long, device=images.device)
    hidden = backbone.vision_model(pixel_values=patches, pixel_attention_mask=mask,
                                   spatial_shapes=spatial_shapes).last_hidden_state
    vit = backbone.mlp1(pixel_shuffle(hidden, grid, c.pixel_shuffle))
    embeds = backbone.language_model.embed_tokens(input_ids)
    is_image = input_ids == c.image_token_id
    expected = cams * vit.shape[1]
    assert bool((is_image.sum(dim=1) == expected).all())
    embeds = embeds.masked_scatter(is_image[..., None], vit.reshape(b * expected, -1).to(embeds.dtype))
    return backbone.language_model(inputs_embeds=embeds, attention_mask=attention_mask,
                                   use_cache=False).last_hidden_state


@pytest.mark.parametrize("padding", ["left", "one_right"])
def test_loss_and_gradients_equal_the_former_forward_bit_for_bit(tiny, monkeypatch, padding: str) -> None:  # noqa: ANN001
    policy, processor = tiny
    c = policy.config
    inputs = processor(_raw(c))
    if padding == "one_right":
        inputs = _right_padded(inputs, 1, c)
        s = inputs["input_ids"].shape[1]
        index = inputs[pre.IMAGE_INDEX_KEY]
        assert set((index[index // s == 0] % s).tolist()) != set((index[index // s == 1] % s).tolist())
    noise = torch.randn(3, c.chunk_size, c.max_action_dim, generator=torch.Generator().manual_seed(2))
    time = policy.action_head.sample_time(3)
    ours, ours_grads = loss_and_grads(policy, inputs, noise, time)
    direct, direct_grads = loss_and_grads(policy, _without_precomputed(inputs), noise, time)
    with monkeypatch.context() as m:
        backbone = policy.backbone
        calls: list[int] = []
        m.setattr(backbone, "forward", lambda *a, **k: calls.append(1) or former_backbone(backbone, *a, **k))
        former, former_grads = loss_and_grads(policy, _without_precomputed(inputs), noise, time)
    assert calls == [1]
    assert torch.equal(ours, former) and torch.equal(direct, former)
    assert set(ours_grads) == set(former_grads) == set(direct_grads)
    for prefix in ("backbone.vision_model.embeddings.position_embedding.", "backbone.vision_model.encoder.",
                   "backbone.mlp1.", "backbone.language_model.embed_tokens.", "backbone.language_model.norm.",
                   "action_head."):
        assert any(n.startswith(prefix) for n in ours_grads), prefix
    for name, g in former_grads.items():
        assert torch.equal(ours_grads[name], g), name
        assert torch.equal(direct_grads[name], g), name


def test_predicted_actions_are_those_of_the_direct_path(tiny) -> None:  # noqa: ANN001
    policy, processor = tiny
    inputs = processor(_raw(policy.config), train=False)
    assert set(pre.PRECOMPUTED_KEYS) <= set(inputs)
    noise = torch.randn(3, policy.config.chunk_size, policy.config.max_action_dim)
    policy.eval()
    try:
        a = policy.predict_action_chunk(inputs, noise=noise)
        b = policy.predict_action_chunk(_without_precomputed(inputs), noise=noise)
    finally:
        policy.train()
    assert torch.equal(a, b)


def test_host_drawn_times_equal_times_passed_explicitly(tiny) -> None:  # noqa: ANN001
    policy, processor = tiny
    inputs = processor(_raw(policy.config))
    check_host_drawn_times(policy, inputs)
    with pytest.raises(LoongError, match="'action'"):
        policy.host_draws({k: v for k, v in inputs.items() if k != "action"})


def test_the_processor_refuses_what_the_step_no_longer_checks(tiny) -> None:  # noqa: ANN001
    policy, processor = tiny
    c = policy.config
    raw = _raw(c)
    raw["embodiment_id"] = torch.tensor([0, c.num_embodiments, 1])
    with pytest.raises(LoongError, match="groot_n1_6 processor: embodiment_id must be in"):
        processor(raw)
    raw["embodiment_id"] = torch.tensor([0, -1, 1])
    with pytest.raises(LoongError, match="embodiment_id must be in"):
        processor(raw)
    inputs = processor(_raw(c))
    ids = inputs["input_ids"].clone()
    ids[1, ids[1] == c.image_token_id] = 0  # a prompt whose image tokens do not match the cameras
    with pytest.raises(LoongError, match=r"input_ids has \[.*\] image tokens per sample"):
        pre.precompute(ids, c, len(CAMERAS), where="groot_n1_6 processor")
    # the step checks the precomputed tensors' shapes (no reads) and names the key
    short = dict(inputs)
    short[pre.IMAGE_INDEX_KEY] = inputs[pre.IMAGE_INDEX_KEY][:-1]
    with pytest.raises(LoongError, match=pre.IMAGE_INDEX_KEY):
        policy(short, time=torch.full((3,), 0.5))
    other_size = dict(inputs)
    other_size["pixel_values"] = torch.zeros(3, len(CAMERAS), 3, c.image_size[0] + 2 * c.patch_size * c.pixel_shuffle,
                                             c.image_size[1])
    with pytest.raises(LoongError, match=pre.POS_WEIGHT_KEY):
        policy(other_size, time=torch.full((3,), 0.5))
    # the direct callers' path keeps the count check
    direct = _without_precomputed(inputs)
    direct["input_ids"] = ids
    with pytest.raises(LoongError, match="prompt and image_size disagree"):
        policy(direct, time=torch.full((3,), 0.5))
