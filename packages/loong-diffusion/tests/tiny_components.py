"""Tiny random Wan pipeline components written to disk in-process (no downloads), for tests.

* :func:`tiny_vae_folder`: a diffusers ``AutoencoderKLWan`` folder (``config.json`` + weights), the Wan 2.1
  16-channel layout (8× spatial, 4× temporal) or, ``z_dim=48``, Wan 2.2's residual 48-channel one (16× spatial
  through its 2×2 patching, 4× temporal). Loads with ``AutoencoderKLWan.from_pretrained(path)``.
* :func:`tiny_text_encoder_folder`: a diffusers-pipeline-style root with ``text_encoder/`` (a transformers
  ``UMT5EncoderModel``) and ``tokenizer/`` (a T5 Unigram tokenizer, ``AutoTokenizer``-loadable, ``<pad>`` = 0,
  ``</s>`` = 1 appended to every prompt, as a ``WanPipeline`` expects).
* :func:`tiny_image_encoder_folder`: a diffusers-I2V-pipeline-style root with ``image_encoder/`` (a transformers
  ``CLIPVisionModel`` of width :data:`TINY_IMAGE_DIM`, the ``tiny_i2v`` preset's ``image_dim``) and
  ``image_processor/`` (a ``CLIPImageProcessor`` to its 16-pixel input: :data:`TINY_IMAGE_TOKENS` tokens).

Sizes are chosen so that one encode or decode of a 5-frame 32×32 clip takes a few tens of milliseconds on CPU.
The weights are random but seeded, so two calls with the same arguments write equal folders.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

#: the width of the tiny text encoder's output, equal to the ``tiny`` Wan presets' ``text_dim``
TINY_TEXT_DIM = 32

#: the tiny CLIP image encoder's width (the ``tiny_i2v`` preset's ``image_dim``) and tokens per image (16×16 pixels
#: in 8×8 patches, plus the class token)
TINY_IMAGE_DIM, TINY_IMAGE_TOKENS = 24, 5

#: text the tiny tokenizer's word pieces come from (captions of the kind the tests use); any other word falls back
#: to single characters, so every ASCII prompt tokenises without ``<unk>``
_SHIPPED_TEXT = """
a red ball rolls across a green field . a blue square moves to the left . the camera pans slowly over the city
at night . a cat jumps onto the table , then sits down . waves break on the beach under a cloudy sky . a person
walks through the forest in autumn . a car drives along the road in the rain . two birds fly over the lake .
"""


def tiny_vae_folder(path: str | Path, z_dim: int = 16, seed: int = 0) -> Path:
    """Write a tiny random ``AutoencoderKLWan`` to ``path`` and return ``path``.

    ``z_dim=16``: the Wan 2.1 layout (RGB in, 8× spatial and 4× temporal compression). ``z_dim=48``: the Wan 2.2
    layout (``is_residual``, 2×2 input patching into 12 channels, so 16× spatial). ``latents_mean`` /
    ``latents_std`` are set to non-trivial per-channel values (seeded), so a consumer that forgets the
    normalisation gives a different result.
    """
    from diffusers import AutoencoderKLWan

    if z_dim not in (16, 48):
        raise ValueError(f"z_dim: 16 (Wan 2.1) or 48 (Wan 2.2), got {z_dim}")
    g = torch.Generator().manual_seed(seed + 17)
    mean = (torch.randn(z_dim, generator=g) * 0.5).tolist()
    std = (0.5 + torch.rand(z_dim, generator=g)).tolist()
    common = dict(base_dim=8, z_dim=z_dim, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
                  temperal_downsample=[False, True, True], latents_mean=mean, latents_std=std)
    torch.manual_seed(seed)
    if z_dim == 16:
        vae = AutoencoderKLWan(**common)
    else:
        vae = AutoencoderKLWan(**common, decoder_base_dim=12, is_residual=True, in_channels=12, out_channels=12,
                               patch_size=2, scale_factor_spatial=16)
    folder = Path(path)
    vae.eval().save_pretrained(folder)
    return folder


def _tiny_vocab() -> list[tuple[str, float]]:
    """The Unigram vocabulary: T5's specials first (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2), whole words of
    :data:`_SHIPPED_TEXT` (preferred: a higher score), then printable ASCII characters with and without the word
    boundary mark as the fallback."""
    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -4.0)]
    seen = {piece for piece, _ in vocab}
    for word in re.findall(r"\S+", _SHIPPED_TEXT):
        if "\u2581" + word not in seen:
            seen.add("\u2581" + word)
            vocab.append(("\u2581" + word, -2.0))
    for code in range(33, 127):
        for piece in (chr(code), "\u2581" + chr(code)):
            if piece not in seen:
                seen.add(piece)
                vocab.append((piece, -8.0))
    return vocab


def tiny_tokenizer():  # noqa: ANN201 (a transformers T5Tokenizer)
    """The tiny T5 tokenizer (transformers' Unigram-backed ``T5Tokenizer``, no sentinel tokens)."""
    from transformers import T5Tokenizer

    return T5Tokenizer(vocab=_tiny_vocab(), extra_ids=0)


def tiny_text_encoder_folder(path: str | Path, seed: int = 0) -> Path:
    """Write a tiny random text encoder to ``path`` and return ``path``, laid out like a diffusers Wan pipeline:

    * ``path/text_encoder/``: a ``UMT5EncoderModel`` (``d_model`` = :data:`TINY_TEXT_DIM`, 2 layers, 2 heads);
    * ``path/tokenizer/``: its tokenizer (``AutoTokenizer.from_pretrained`` loads it).
    """
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = tiny_tokenizer()
    config = UMT5Config(vocab_size=len(tokenizer), d_model=TINY_TEXT_DIM, d_kv=8, d_ff=64, num_layers=2,
                        num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                        dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                        decoder_start_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = UMT5EncoderModel(config).eval()
    folder = Path(path)
    model.save_pretrained(folder / "text_encoder")
    tokenizer.save_pretrained(folder / "tokenizer")
    return folder


def tiny_image_encoder_folder(path: str | Path, seed: int = 0) -> Path:
    """Write a tiny random CLIP image encoder to ``path`` and return ``path``, laid out like a diffusers Wan I2V
    pipeline: ``path/image_encoder/`` (a ``CLIPVisionModel``: 2 layers, so that the penultimate hidden state Wan
    takes is the first layer's output) and ``path/image_processor/`` (a ``CLIPImageProcessor``: shortest edge
    resized to 16, centre-cropped to 16×16, CLIP's normalisation). Without torchvision, transformers loads the
    processor as its PIL-backed ``CLIPImageProcessorPil``, which takes the same PIL images."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(hidden_size=TINY_IMAGE_DIM, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=2, image_size=16, patch_size=8, projection_dim=TINY_IMAGE_DIM)
    torch.manual_seed(seed)
    model = CLIPVisionModel(config).eval()
    folder = Path(path)
    model.save_pretrained(folder / "image_encoder")
    CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}).save_pretrained(
        folder / "image_processor")
    return folder


__all__ = ["TINY_IMAGE_DIM", "TINY_IMAGE_TOKENS", "TINY_TEXT_DIM", "tiny_image_encoder_folder",
           "tiny_text_encoder_folder", "tiny_tokenizer", "tiny_vae_folder"]
