"""GR00T N1.7's config: lerobot 0.6.1's ``GrootConfig`` / ``GR00TN17Config`` published defaults, flattened.

The backbone is Cosmos-Reason2-2B (a Qwen3-VL-2B layout) truncated after ``select_layer`` decoder layers; the
action head is the shared GR00T head (:mod:`loong.embodied.policies.groot`). ``backbone`` holds the transformers
``Qwen3VLConfig`` keyword arguments (None: Cosmos-Reason2-2B's published config.json, as lerobot hard-codes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loong.core.errors import LoongError
from loong.embodied.policies.base import PolicyConfig
from loong.embodied.policies.groot import ActionHeadConfig, DiTConfig, SelfAttentionConfig

#: lerobot's GR00T N1.7 embodiment tags -> embodiment ids (``N1_7_EMBODIMENT_MAPPING``)
EMBODIMENT_IDS: dict[str, int] = {
    "oxe_droid_relative_eef_relative_joint": 24,
    "xdof_relative_eef_relative_joint": 27,
    "real_g1_relative_eef_relative_joints": 25,
    "real_r1_pro_sharpa_relative_eef": 26,
    "unitree_g1_full_body_with_waist_height_nav_cmd": 25,
    "simpler_env_google": 0,
    "simpler_env_widowx": 1,
    "libero_sim": 2,
    "new_embodiment": 10,
}


def cosmos_reason2_backbone() -> dict[str, Any]:
    """``Qwen3VLConfig`` kwargs of nvidia/Cosmos-Reason2-2B (its config.json; lerobot's hard-coded copy)."""
    return {
        "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "tie_word_embeddings": True,
        "text_config": {
            "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
            "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
            "intermediate_size": 6144, "max_position_embeddings": 262144, "num_attention_heads": 16,
            "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-6,
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
            "rope_theta": 5000000, "tie_word_embeddings": True, "vocab_size": 151936,
        },
        "vision_config": {
            "deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 1024, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096,
            "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2,
        },
    }


@dataclass
class GrootN17Config(PolicyConfig):
    """GR00T N1.7 (published: 40-step chunks, 132-wide state/action, 4 Euler steps, 32-layer DiT)."""

    chunk_size: int = 40
    n_action_steps: int = 40
    max_state_dim: int = 132
    max_action_dim: int = 132
    num_inference_steps: int = 4

    # backbone (Qwen3-VL, truncated)
    backbone: dict[str, Any] | None = None
    select_layer: int = 16
    tune_llm: bool = False
    tune_visual: bool = False
    tune_top_llm_layers: int = 0
    #: a Hugging Face Qwen3-VL folder (e.g. ``loong-vlm convert`` of a qwen3_vl run) whose config.json gives the
    #: backbone's shape (``backbone`` is replaced; ``select_layer`` is kept) and whose weights start a fresh run
    base_model_path: str | None = None

    # action head
    hidden_size: int = 1024
    input_embedding_dim: int = 1536
    backbone_embedding_dim: int = 2048
    num_embodiments: int = 32
    state_history_length: int = 1
    add_pos_embed: bool = True
    max_seq_len: int = 1024
    use_vlln: bool = True
    state_dropout_prob: float = 0.2
    dit_num_layers: int = 32
    dit_num_heads: int = 32
    dit_head_dim: int = 48
    dit_dropout: float = 0.2
    use_alternate_vl_dit: bool = True
    attend_text_every_n_blocks: int = 2
    vl_self_attention_layers: int = 4
    vl_self_attention_heads: int = 32
    vl_self_attention_head_dim: int = 64
    vl_self_attention_dropout: float = 0.2
    noise_beta_alpha: float = 1.5
    noise_beta_beta: float = 1.0
    noise_s: float = 0.999
    num_timestep_buckets: int = 1000
    tune_projector: bool = True
    tune_diffusion_model: bool = True
    tune_vlln: bool = True

    # processor
    processor: str | None = None
    embodiment_tag: str = "new_embodiment"
    image_target_size: tuple[int, int] = (256, 256)
    image_crop_size: tuple[int, int] = (230, 230)
    formalize_language: bool = True
    clip_outliers: bool = True

    def __post_init__(self) -> None:
        if self.base_model_path is not None:
            from loong.embodied.policies.groot_n1_7.backbone_init import read_backbone_config

            self.backbone = read_backbone_config(self.base_model_path, self.backbone_dict())
        if self.n_action_steps > self.chunk_size:
            raise LoongError(f"groot_n1_7: n_action_steps ({self.n_action_steps}) must be <= chunk_size "
                             f"({self.chunk_size})")
        if self.dit_num_heads * self.dit_head_dim != self.input_embedding_dim:
            raise LoongError(f"groot_n1_7: dit_num_heads * dit_head_dim ({self.dit_num_heads * self.dit_head_dim}) "
                             f"must equal input_embedding_dim ({self.input_embedding_dim})")
        if self.vl_self_attention_layers and (self.vl_self_attention_heads * self.vl_self_attention_head_dim
                                              != self.backbone_embedding_dim):
            raise LoongError("groot_n1_7: vl_self_attention_heads * vl_self_attention_head_dim must equal "
                             f"backbone_embedding_dim ({self.backbone_embedding_dim})")
        if self.embodiment_tag not in EMBODIMENT_IDS:
            raise LoongError(f"groot_n1_7.embodiment_tag: unknown {self.embodiment_tag!r}; known: "
                             f"{', '.join(EMBODIMENT_IDS)}")
        text_hidden = self.backbone_dict()["text_config"]["hidden_size"]
        if text_hidden != self.backbone_embedding_dim:
            raise LoongError(f"groot_n1_7: backbone_embedding_dim ({self.backbone_embedding_dim}) must equal the "
                             f"backbone text hidden_size ({text_hidden})")

    @property
    def embodiment_id(self) -> int:
        """The embodiment id of ``embodiment_tag`` (used when a batch names none)."""
        return EMBODIMENT_IDS[self.embodiment_tag]

    def backbone_dict(self) -> dict[str, Any]:
        return self.backbone if self.backbone is not None else cosmos_reason2_backbone()

    def action_head_config(self) -> ActionHeadConfig:
        """The shared head's config for these fields."""
        return ActionHeadConfig(
            max_state_dim=self.max_state_dim, max_action_dim=self.max_action_dim, action_horizon=self.chunk_size,
            state_history_length=self.state_history_length, hidden_size=self.hidden_size,
            input_embedding_dim=self.input_embedding_dim, backbone_embedding_dim=self.backbone_embedding_dim,
            num_embodiments=self.num_embodiments, add_pos_embed=self.add_pos_embed, max_seq_len=self.max_seq_len,
            use_vlln=self.use_vlln, state_dropout_prob=self.state_dropout_prob, use_state_mask_token=False,
            dit=DiTConfig(num_layers=self.dit_num_layers, num_attention_heads=self.dit_num_heads,
                          attention_head_dim=self.dit_head_dim, output_dim=self.hidden_size,
                          cross_attention_dim=self.backbone_embedding_dim, dropout=self.dit_dropout,
                          use_alternate_vl_dit=self.use_alternate_vl_dit,
                          attend_text_every_n_blocks=self.attend_text_every_n_blocks),
            vl_self_attention=SelfAttentionConfig(num_layers=self.vl_self_attention_layers,
                                                  num_attention_heads=self.vl_self_attention_heads,
                                                  attention_head_dim=self.vl_self_attention_head_dim,
                                                  dropout=self.vl_self_attention_dropout),
            num_inference_steps=self.num_inference_steps, noise_beta_alpha=self.noise_beta_alpha,
            noise_beta_beta=self.noise_beta_beta, noise_s=self.noise_s,
            num_timestep_buckets=self.num_timestep_buckets)


def tiny_backbone(vocab_size: int = 320) -> dict[str, Any]:
    """A 2-layer, 64-wide Qwen3-VL for CPU tests (token ids of :mod:`.tiny_processor`'s vocabulary)."""
    return {
        "image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 3, "vision_end_token_id": 4,
        "tie_word_embeddings": True,
        "text_config": {
            "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True,
                                "rope_theta": 10000.0},
            "tie_word_embeddings": True,
        },
        "vision_config": {
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
            "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 1],
        },
    }


def tiny() -> GrootN17Config:
    """CPU preset: tiny Qwen3-VL (2 text layers, all kept), 2-layer DiT, 1-layer VL self-attention.

    Avoids lerobot's "N1.5 default" values (max_state_dim 64, max_action_dim 32, chunk 50), which its
    GrootConfig silently remaps, so the same numbers work on both sides.
    """
    return GrootN17Config(
        chunk_size=8, n_action_steps=8, max_state_dim=16, max_action_dim=16, num_inference_steps=4,
        backbone=tiny_backbone(), select_layer=2, tune_llm=True, tune_visual=True,
        hidden_size=32, input_embedding_dim=32, backbone_embedding_dim=64, num_embodiments=32, max_seq_len=64,
        dit_num_layers=2, dit_num_heads=2, dit_head_dim=16, dit_dropout=0.0,
        vl_self_attention_layers=1, vl_self_attention_heads=2, vl_self_attention_head_dim=32,
        vl_self_attention_dropout=0.0, state_dropout_prob=0.0)


PRESETS: dict[str, GrootN17Config] = {"tiny": tiny(), "groot_n1_7": GrootN17Config()}

__all__ = ["EMBODIMENT_IDS", "PRESETS", "GrootN17Config", "cosmos_reason2_backbone", "tiny", "tiny_backbone"]
