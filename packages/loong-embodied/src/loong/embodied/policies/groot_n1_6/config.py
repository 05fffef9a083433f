"""GR00T N1.6's configuration: the published ``nvidia/GR00T-N1.6-3B`` shape, every size spelled out.

Sources (read for facts, no code taken): Isaac-GR00T ``gr00t/configs/model/gr00t_n1d6.py`` (``Gr00tN1d6Config``
defaults: ``select_layer=16``, ``tune_top_llm_layers=4``, ``tune_llm=tune_visual=False``, 32-layer alternate-VL DiT
of 32 heads x 48, ``hidden_size=1024``, ``input_embedding_dim=1536``, ``backbone_embedding_dim=2048``, 4 inference
steps, Beta(1.5, 1) time, 32 embodiments), the Eagle-Block2A-2B-v2 ``config.json`` it builds its backbone from
(SigLIP2: width 1152, depth 27, MLP 4304, 16 heads, patch 14, 256 position embeddings, ``use_rope=false``,
``use_windows_attn=false``; pixel shuffle ``downsample_ratio=0.5``; Qwen3-1.7B: width 2048, 28 layers, MLP 6144,
16 heads / 8 KV heads of 128, vocab 151680, RoPE theta 1e6; image token id 151669), and the published checkpoint's
``config.json`` (``max_state_dim=max_action_dim=128``, ``action_horizon=50``; as recorded by checkpoints
fine-tuned from it).
"""

from __future__ import annotations

from dataclasses import dataclass

from loong.core.errors import LoongError
from loong.embodied.policies.base import PolicyConfig

#: the tokenizer the ``tiny`` preset builds in-process from the shipped corpus (see :mod:`.processor`)
TINY_TOKENIZER = "builtin:tiny"

#: Isaac-GR00T's ``EMBODIMENT_TAG_TO_PROJECTOR_INDEX`` (processing_gr00t_n1d6.py): which per-embodiment
#: projector row each pre-registered robot uses in the published checkpoint
EMBODIMENT_IDS: dict[str, int] = {
    "oxe_google": 0,
    "oxe_widowx": 1,
    "libero_panda": 2,
    "unitree_g1": 8,
    "new_embodiment": 10,
    "robocasa_panda_omron": 13,
    "oxe_droid": 16,
    "gr1": 20,
    "behavior_r1_pro": 24,
}


@dataclass
class GrootN16Config(PolicyConfig):
    """GR00T N1.6: Eagle 3 VL backbone (SigLIP2 + pixel shuffle + MLP + Qwen3 cut at ``select_layer``) and the
    GR00T flow-matching action head (alternate-VL DiT, per-embodiment encoders/decoder, no VL self-attention).

    ``chunk_size`` is GR00T's ``action_horizon``; ``num_inference_steps`` its ``num_inference_timesteps``.

    Backbone: ``vision_*`` the SigLIP2 tower (full attention per image, no RoPE, no windows: the published
    settings, which are plain SigLIP2), ``pixel_shuffle`` the space-to-depth factor (``1 / downsample_ratio``) before
    the ``mlp1`` connector, ``text_*`` the Qwen3 language model of which only the first ``select_layer`` layers are
    built (GR00T pops the rest) and whose final norm is kept. ``image_size`` ``(h, w)``: the resolution every
    camera is resized to (a multiple of ``patch_size * pixel_shuffle``; 252 is what a square frame becomes in
    Isaac-GR00T: shortest edge 256 around its 0.95 crop, then Eagle's ``smart_resize`` rounds each side to a multiple
    of 28; a 4:3 frame becomes (252, 336)); tokens per image ``h * w / (patch * shuffle) ** 2``.

    Freezing (``requires_grad=False`` at construction): ``tune_llm=False`` freezes the language model except its
    top ``tune_top_llm_layers`` layers; ``tune_visual=False`` the vision tower and ``mlp1``; ``tune_projector`` /
    ``tune_diffusion_model`` / ``tune_vlln`` the head's encoders+decoder, DiT, and VL LayerNorm.

    Data: ``tokenizer`` a local tokenizer folder (the Eagle-Block2A-2B-v2 / Qwen3 tokenizer for real checkpoints) or
    ``"builtin:tiny"``; ``tokenizer_max_length`` the padded prompt length (left padding, as GR00T); ``embodiment``
    the default embodiment tag (a key of :data:`EMBODIMENT_IDS`) when a batch names none.
    """

    chunk_size: int = 50
    n_action_steps: int = 50
    max_state_dim: int = 128
    max_action_dim: int = 128
    num_inference_steps: int = 4
    # vision tower (SigLIP2 400M/14 as Eagle-Block2A-2B-v2 configures it)
    image_size: tuple[int, int] = (252, 252)
    patch_size: int = 14
    vision_hidden_size: int = 1152
    vision_intermediate_size: int = 4304
    vision_num_layers: int = 27
    vision_num_heads: int = 16
    vision_num_patches: int = 256
    vision_layer_norm_eps: float = 1e-6
    pixel_shuffle: int = 2
    # language model (Qwen3-1.7B), truncated at select_layer
    vocab_size: int = 151680
    text_hidden_size: int = 2048
    text_intermediate_size: int = 6144
    text_num_layers: int = 28
    text_num_heads: int = 16
    text_num_kv_heads: int = 8
    text_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    select_layer: int = 16
    image_token_id: int = 151669
    # freezing
    tune_llm: bool = False
    tune_visual: bool = False
    tune_top_llm_layers: int = 4
    tune_projector: bool = True
    tune_diffusion_model: bool = True
    tune_vlln: bool = True
    # action head
    hidden_size: int = 1024
    input_embedding_dim: int = 1536
    num_embodiments: int = 32
    add_pos_embed: bool = True
    max_seq_len: int = 1024
    use_vlln: bool = True
    state_dropout_prob: float = 0.0
    dit_num_layers: int = 32
    dit_num_heads: int = 32
    dit_head_dim: int = 48
    dit_dropout: float = 0.2
    attend_text_every_n_blocks: int = 2
    noise_beta_alpha: float = 1.5
    noise_beta_beta: float = 1.0
    noise_s: float = 0.999
    num_timestep_buckets: int = 1000
    # data
    tokenizer: str | None = None
    tokenizer_max_length: int = 512
    embodiment: str = "new_embodiment"
    formalize_language: bool = True

    @property
    def backbone_embedding_dim(self) -> int:
        """The VL token width the head reads (Eagle's LM width; GR00T's ``backbone_embedding_dim``)."""
        return self.text_hidden_size

    @property
    def tokens_per_image(self) -> int:
        """Image tokens one camera contributes after the pixel shuffle."""
        step = self.patch_size * self.pixel_shuffle
        return (self.image_size[0] // step) * (self.image_size[1] // step)

    def __post_init__(self) -> None:
        self.image_size = tuple(int(v) for v in self.image_size)  # type: ignore[assignment]
        if len(self.image_size) != 2:
            raise LoongError(f"groot_n1_6.image_size: expected (height, width), got {self.image_size}")
        step = self.patch_size * self.pixel_shuffle
        if any(v <= 0 or v % step for v in self.image_size):
            raise LoongError(f"groot_n1_6.image_size: {self.image_size} must be positive multiples of "
                             f"patch_size * pixel_shuffle = {step}")
        grid = round(self.vision_num_patches ** 0.5)
        if grid * grid != self.vision_num_patches:
            raise LoongError(f"groot_n1_6.vision_num_patches: {self.vision_num_patches} must be a square")
        if not 1 <= self.select_layer <= self.text_num_layers:
            raise LoongError(f"groot_n1_6.select_layer: {self.select_layer} must be in [1, {self.text_num_layers}]")
        if not 0 <= self.tune_top_llm_layers <= self.select_layer:
            raise LoongError(f"groot_n1_6.tune_top_llm_layers: {self.tune_top_llm_layers} must be in "
                             f"[0, select_layer={self.select_layer}]")
        if self.input_embedding_dim != self.dit_num_heads * self.dit_head_dim:
            raise LoongError(f"groot_n1_6.input_embedding_dim: {self.input_embedding_dim} must equal dit_num_heads *"
                             f" dit_head_dim = {self.dit_num_heads * self.dit_head_dim}")
        if self.embodiment not in EMBODIMENT_IDS:
            raise LoongError(f"groot_n1_6.embodiment: unknown tag {self.embodiment!r}; known: "
                             f"{', '.join(sorted(EMBODIMENT_IDS))}")
        if EMBODIMENT_IDS[self.embodiment] >= self.num_embodiments:
            raise LoongError(f"groot_n1_6.num_embodiments: {self.num_embodiments} has no row for embodiment "
                             f"{self.embodiment!r} (id {EMBODIMENT_IDS[self.embodiment]})")
        if self.chunk_size > self.max_seq_len:
            raise LoongError(f"groot_n1_6.chunk_size: {self.chunk_size} exceeds max_seq_len={self.max_seq_len}")
        if not 1 <= self.n_action_steps <= self.chunk_size:
            raise LoongError(f"groot_n1_6.n_action_steps: {self.n_action_steps} must be in [1, chunk_size]")

    @property
    def embodiment_id(self) -> int:
        """The projector row of :attr:`embodiment`."""
        return EMBODIMENT_IDS[self.embodiment]


#: the published nvidia/GR00T-N1.6-3B shape
GROOT_N1_6 = GrootN16Config()

#: a CPU-sized GR00T N1.6 with every piece present (4 DiT layers, so both text and image cross-attention occur)
TINY = GrootN16Config(
    chunk_size=4, n_action_steps=4, max_state_dim=8, max_action_dim=8, num_inference_steps=2,
    image_size=(16, 16), patch_size=4, vision_hidden_size=32, vision_intermediate_size=64, vision_num_layers=2,
    vision_num_heads=2, vision_num_patches=16,
    vocab_size=512, text_hidden_size=32, text_intermediate_size=64, text_num_layers=3, text_num_heads=4,
    text_num_kv_heads=2, text_head_dim=8, max_position_embeddings=512, select_layer=2, image_token_id=5,
    tune_top_llm_layers=1,
    hidden_size=24, input_embedding_dim=16, dit_num_layers=4, dit_num_heads=2, dit_head_dim=8, dit_dropout=0.0,
    max_seq_len=32, tokenizer=TINY_TOKENIZER, tokenizer_max_length=48,
)

PRESETS: dict[str, GrootN16Config] = {"tiny": TINY, "groot_n1_6": GROOT_N1_6}

__all__ = ["EMBODIMENT_IDS", "GROOT_N1_6", "PRESETS", "TINY", "TINY_TOKENIZER", "GrootN16Config"]
