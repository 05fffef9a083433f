"""Pi0.5's configuration: the published shape (PaliGemma 3B + Gemma-300M action expert) with size knobs.

lerobot's ``PI05Config`` names its sizes by variant (``paligemma_variant="gemma_2b"``, ``action_expert_variant=
"gemma_300m"``, widths from ``get_gemma_config``) and hard-codes SigLIP so400m; Loong spells every size out so a
``tiny`` preset trains on a CPU in seconds. The defaults are the published ones (openpi ``pi05`` / lerobot 0.6.1).
"""

from __future__ import annotations

from dataclasses import dataclass

from loong.core.errors import LoongError
from loong.embodied.policies.base import PolicyConfig

#: the tokenizer the ``tiny`` preset builds in-process (see :func:`loong.embodied.policies.pi05.tokenizer.tiny_tokenizer`)
TINY_TOKENIZER = "builtin:tiny"
#: the tokenizer lerobot's Pi0.5 processor loads (a gated Hub repo; Loong reads it only from a local folder)
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"


@dataclass
class Pi05Config(PolicyConfig):
    """Pi0.5 (openpi; lerobot ``PI05Policy``): PaliGemma prefix, Gemma action expert in joint attention.

    Sizes: ``vision_*`` is the SigLIP tower (so400m: width 1152, depth 27, MLP 4304, 16 heads, patch 14); ``vlm_*``
    the PaliGemma language model (Gemma 2B: width 2048, depth 18, MLP 16384); ``expert_*`` the action expert
    (Gemma 300M: width 1024, MLP 4096) with one layer per VLM layer. The two Gemmas attend jointly, so they share
    ``num_heads`` / ``num_kv_heads`` / ``head_dim`` (8 / 1 / 256 published).

    Data: ``image_size`` is the square resolution images are resized (with padding) to; ``empty_cameras`` adds
    that many all-padding cameras; ``tokenizer_max_length`` the prompt length; ``tokenizer`` a local tokenizer
    folder (a PaliGemma tokenizer for real checkpoints) or ``"builtin:tiny"``.

    Training: ``tune_llm=False`` freezes the language model (embeddings, its half of every layer, final norm),
    ``tune_visual=False`` the SigLIP tower; with both off the projector is frozen too (lerobot's
    ``train_expert_only``). Flow matching: ``t ~ Beta(alpha, beta) * scale + offset``; the timestep's sinusoidal
    embedding spans periods ``[min_period, max_period]``.
    """

    # vision tower (SigLIP so400m/14 at 224)
    image_size: int = 224
    patch_size: int = 14
    vision_width: int = 1152
    vision_depth: int = 27
    vision_mlp_dim: int = 4304
    vision_num_heads: int = 16
    # PaliGemma language model (Gemma 2B)
    vocab_size: int = 257152
    vlm_width: int = 2048
    vlm_depth: int = 18
    vlm_mlp_dim: int = 16384
    # action expert (Gemma 300M), one layer per VLM layer
    expert_width: int = 1024
    expert_mlp_dim: int = 4096
    # attention, shared by both Gemmas (joint attention)
    num_heads: int = 8
    num_kv_heads: int = 1
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # data
    empty_cameras: int = 0
    tokenizer_max_length: int = 200
    tokenizer: str | None = None
    # training
    tune_llm: bool = True
    tune_visual: bool = True
    time_sampling_beta_alpha: float = 1.5
    time_sampling_beta_beta: float = 1.0
    time_sampling_scale: float = 0.999
    time_sampling_offset: float = 0.001
    min_period: float = 4e-3
    max_period: float = 4.0

    def __post_init__(self) -> None:
        for name in ("chunk_size", "n_action_steps", "max_state_dim", "max_action_dim", "num_inference_steps",
                     "image_size", "patch_size", "vision_width", "vision_depth", "vision_mlp_dim", "vision_num_heads",
                     "vocab_size", "vlm_width", "vlm_depth", "vlm_mlp_dim", "expert_width", "expert_mlp_dim",
                     "num_heads", "num_kv_heads", "head_dim", "tokenizer_max_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LoongError(f"pi05.{name}: must be an int >= 1, got {value!r}")
        if self.n_action_steps > self.chunk_size:
            raise LoongError(f"pi05.n_action_steps: {self.n_action_steps} exceeds chunk_size {self.chunk_size}")
        if self.image_size % self.patch_size:
            raise LoongError(f"pi05.image_size: {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.vision_width % self.vision_num_heads:
            raise LoongError(f"pi05.vision_width: {self.vision_width} is not divisible by vision_num_heads "
                             f"{self.vision_num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise LoongError(f"pi05.num_heads: {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2 or self.expert_width % 2:
            raise LoongError("pi05.head_dim and pi05.expert_width must be even (RoPE and the sinusoidal time embedding)")
        if not isinstance(self.empty_cameras, int) or self.empty_cameras < 0:
            raise LoongError(f"pi05.empty_cameras: must be an int >= 0, got {self.empty_cameras!r}")

    @property
    def num_image_tokens(self) -> int:
        """Tokens SigLIP makes of one camera image."""
        return (self.image_size // self.patch_size) ** 2


def tiny() -> Pi05Config:
    """The CPU preset: 64² images, two 2-layer Gemmas 64 wide, the built-in tiny tokenizer (trains in seconds)."""
    return Pi05Config(
        chunk_size=8, n_action_steps=4, max_state_dim=8, max_action_dim=8, num_inference_steps=10,
        image_size=64, patch_size=16, vision_width=32, vision_depth=1, vision_mlp_dim=64, vision_num_heads=2,
        vocab_size=512, vlm_width=64, vlm_depth=2, vlm_mlp_dim=128, expert_width=64, expert_mlp_dim=128,
        num_heads=4, num_kv_heads=1, head_dim=16, tokenizer_max_length=32, tokenizer=TINY_TOKENIZER)


def published() -> Pi05Config:
    """The published Pi0.5 (openpi ``pi05_base`` / lerobot ``PI05Config()``): about 3.35B parameters in Loong,
    4,143,404,816 in lerobot, which also holds two unused LM heads (see :func:`lerobot_parameter_count`)."""
    return Pi05Config(tokenizer=None)


def lerobot_parameter_count(config: Pi05Config, loong_count: int) -> int:
    """lerobot's ``PI05Policy`` parameter count for a Loong model of ``loong_count`` parameters.

    lerobot's module keeps two vocabulary-sized matrices Pi0.5 never uses: PaliGemma's LM head (tied to the
    embedding in openpi; lerobot rebuilds the language model after tying, so it counts twice) and the action
    expert's LM head. Loong holds neither (the export writes them, see ``lerobot.py``)."""
    return loong_count + config.vocab_size * (config.vlm_width + config.expert_width)


__all__ = ["PALIGEMMA_TOKENIZER", "Pi05Config", "TINY_TOKENIZER", "lerobot_parameter_count", "published", "tiny"]
