"""Test fixtures for GR00T N1.6: tiny configs, raw batches, and the published checkpoint layout written out
independently of :mod:`loong.embodied.policies.groot_n1_6.checkpoint`.

:func:`published_keys` lists the safetensors keys of a ``Gr00tN1d6`` checkpoint from the published module tree
(Isaac-GR00T ``Gr00tN1d6`` -> ``backbone`` (``EagleBackbone``) -> ``model`` (``Eagle3_VLForConditionalGeneration``)
-> ``vision_model`` (Eagle's ``Siglip2VisionModel``) -> ``vision_model`` (``Siglip2VisionTransformer``:
``embeddings``, ``encoder.layers``, ``post_layernorm``, ``head``); ``mlp1`` (Sequential 0 LayerNorm, 1 Linear,
2 GELU, 3 Linear); ``language_model`` (``Qwen3ForCausalLM``: ``model`` + ``lm_head``), only ``select_layer``
decoder layers; and ``action_head`` (``Gr00tN1d6ActionHead``: ``model`` = ``AlternateVLDiT`` (diffusers blocks),
``state_encoder`` / ``action_decoder`` (``CategorySpecificMLP``), ``action_encoder``
(``MultiEmbodimentActionEncoder``), ``vlln``, ``position_embedding``, ``mask_token`` when state dropout is on).
"""

from __future__ import annotations

import torch

from loong.embodied.policies.groot_n1_6.config import TINY, GrootN16Config

CAMERA = "observation.images.top"
WRIST = "observation.images.wrist"
STATE_DIM, ACTION_DIM = 3, 2


def tiny_config(**changes) -> GrootN16Config:
    """The ``tiny`` preset with ``changes``."""
    return TINY.replace(**changes)  # type: ignore[return-value]


def features(cameras: tuple[str, ...] = (CAMERA, WRIST), hw: tuple[int, int] = (20, 24)) -> dict:
    """lerobot dataset features of the tiny test robot."""
    out = {cam: {"dtype": "video", "shape": [3, *hw], "names": ["channels", "height", "width"]} for cam in cameras}
    out["observation.state"] = {"dtype": "float32", "shape": [STATE_DIM], "names": None}
    out["action"] = {"dtype": "float32", "shape": [ACTION_DIM], "names": None}
    return out


def stats() -> dict:
    """min/max statistics (one zero-range state dim, exercising GR00T's 0 mapping)."""
    return {"observation.state": {"min": [-1.0, 0.0, 0.5], "max": [1.0, 2.0, 0.5]},
            "action": {"min": [-2.0, 0.0], "max": [2.0, 1.0]}}


def raw_batch(chunk: int, *, b: int = 2, cameras: tuple[str, ...] = (CAMERA, WRIST), hw: tuple[int, int] = (20, 24),
              seed: int = 0) -> dict:
    """A raw ``collate_vla``-style batch with random content and one padded action step."""
    g = torch.Generator().manual_seed(seed)
    out = {cam: torch.rand(b, 3, *hw, generator=g) for cam in cameras}
    out["observation.state"] = torch.rand(b, STATE_DIM, generator=g) * 3 - 1.5
    out["action"] = torch.rand(b, chunk, ACTION_DIM, generator=g) * 4 - 2
    pad = torch.zeros(b, chunk, dtype=torch.bool)
    pad[0, -1] = True
    out["action_is_pad"] = pad
    tasks = ["Reach the RED target!", "reach the blue target", "reach the green target", "reach the red target"]
    out["task"] = tasks[:b]
    return out


def published_keys(config: GrootN16Config) -> dict[str, tuple[int, ...]]:
    """Every key (and shape) of a published-layout ``Gr00tN1d6`` checkpoint of ``config``, lm_head and the
    SigLIP2 pooling head included (see the module docstring for the module tree)."""
    c = config
    keys: dict[str, tuple[int, ...]] = {}
    vh, vi = c.vision_hidden_size, c.vision_intermediate_size
    vis = "backbone.model.vision_model.vision_model."
    keys[vis + "embeddings.patch_embedding.weight"] = (vh, 3 * c.patch_size ** 2)
    keys[vis + "embeddings.patch_embedding.bias"] = (vh,)
    keys[vis + "embeddings.position_embedding.weight"] = (c.vision_num_patches, vh)

    def linear(prefix: str, n_out: int, n_in: int, bias: bool = True) -> None:
        keys[prefix + ".weight"] = (n_out, n_in)
        if bias:
            keys[prefix + ".bias"] = (n_out,)

    def norm(prefix: str, n: int, bias: bool = True) -> None:
        keys[prefix + ".weight"] = (n,)
        if bias:
            keys[prefix + ".bias"] = (n,)

    for i in range(c.vision_num_layers):
        layer = f"{vis}encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear(layer + "self_attn." + proj, vh, vh)
        linear(layer + "mlp.fc1", vi, vh)
        linear(layer + "mlp.fc2", vh, vi)
        norm(layer + "layer_norm1", vh)
        norm(layer + "layer_norm2", vh)
    norm(vis + "post_layernorm", vh)
    # the pooling head Eagle's SigLIP2 builds (its config has no vision_use_head) and GR00T never runs
    keys[vis + "head.probe"] = (1, 1, vh)
    keys[vis + "head.attention.in_proj_weight"] = (3 * vh, vh)
    keys[vis + "head.attention.in_proj_bias"] = (3 * vh,)
    linear(vis + "head.attention.out_proj", vh, vh)
    norm(vis + "head.layernorm", vh)
    linear(vis + "head.mlp.fc1", vi, vh)
    linear(vis + "head.mlp.fc2", vh, vi)

    th = c.text_hidden_size
    shuffled = vh * c.pixel_shuffle ** 2
    norm("backbone.model.mlp1.0", shuffled)
    linear("backbone.model.mlp1.1", th, shuffled)
    linear("backbone.model.mlp1.3", th, th)

    lm = "backbone.model.language_model."
    keys[lm + "model.embed_tokens.weight"] = (c.vocab_size, th)
    for i in range(c.select_layer):
        layer = f"{lm}model.layers.{i}."
        linear(layer + "self_attn.q_proj", c.text_num_heads * c.text_head_dim, th, bias=False)
        linear(layer + "self_attn.k_proj", c.text_num_kv_heads * c.text_head_dim, th, bias=False)
        linear(layer + "self_attn.v_proj", c.text_num_kv_heads * c.text_head_dim, th, bias=False)
        linear(layer + "self_attn.o_proj", th, c.text_num_heads * c.text_head_dim, bias=False)
        norm(layer + "self_attn.q_norm", c.text_head_dim, bias=False)
        norm(layer + "self_attn.k_norm", c.text_head_dim, bias=False)
        linear(layer + "mlp.gate_proj", c.text_intermediate_size, th, bias=False)
        linear(layer + "mlp.up_proj", c.text_intermediate_size, th, bias=False)
        linear(layer + "mlp.down_proj", th, c.text_intermediate_size, bias=False)
        norm(layer + "input_layernorm", th, bias=False)
        norm(layer + "post_attention_layernorm", th, bias=False)
    norm(lm + "model.norm", th, bias=False)
    keys[lm + "lm_head.weight"] = (c.vocab_size, th)

    head = "action_head."
    inner, hid, e = c.input_embedding_dim, c.hidden_size, c.num_embodiments
    dit = head + "model."
    linear(dit + "timestep_encoder.timestep_embedder.linear_1", inner, 256)
    linear(dit + "timestep_encoder.timestep_embedder.linear_2", inner, inner)
    for i in range(c.dit_num_layers):
        block = f"{dit}transformer_blocks.{i}."
        context = inner if i % 2 == 1 else c.text_hidden_size  # odd blocks self-attend (interleaved)
        linear(block + "norm1.linear", 2 * inner, inner)
        linear(block + "attn1.to_q", inner, inner)
        linear(block + "attn1.to_k", inner, context)
        linear(block + "attn1.to_v", inner, context)
        linear(block + "attn1.to_out.0", inner, inner)
        linear(block + "ff.net.0.proj", 4 * inner, inner)
        linear(block + "ff.net.2", inner, 4 * inner)
    linear(dit + "proj_out_1", 2 * inner, inner)
    linear(dit + "proj_out_2", hid, inner)

    def category_linear(prefix: str, n_in: int, n_out: int) -> None:
        keys[prefix + ".W"] = (e, n_in, n_out)
        keys[prefix + ".b"] = (e, n_out)

    category_linear(head + "state_encoder.layer1", c.max_state_dim, hid)
    category_linear(head + "state_encoder.layer2", hid, inner)
    category_linear(head + "action_encoder.W1", c.max_action_dim, inner)
    category_linear(head + "action_encoder.W2", 2 * inner, inner)
    category_linear(head + "action_encoder.W3", inner, inner)
    category_linear(head + "action_decoder.layer1", hid, hid)
    category_linear(head + "action_decoder.layer2", hid, c.max_action_dim)
    norm(head + "vlln", c.text_hidden_size)
    keys[head + "position_embedding.weight"] = (c.max_seq_len, inner)
    if c.state_dropout_prob > 0:
        keys[head + "mask_token"] = (1, 1, inner)
    return keys


def published_parameter_count(config: GrootN16Config, *, with_unused: bool) -> int:
    """Parameters of :func:`published_keys` (``with_unused=False``: without lm_head and the pooling head)."""
    total = 0
    for key, shape in published_keys(config).items():
        unused = key.endswith("lm_head.weight") or ".vision_model.vision_model.head." in key
        if with_unused or not unused:
            n = 1
            for d in shape:
                n *= d
            total += n
    return total


__all__ = ["ACTION_DIM", "CAMERA", "STATE_DIM", "WRIST", "features", "published_keys", "published_parameter_count",
           "raw_batch", "stats", "tiny_config"]
