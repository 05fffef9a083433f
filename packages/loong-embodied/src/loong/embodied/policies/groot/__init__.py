"""The GR00T action-head family shared by GR00T N1.6 and N1.7 (backbone-agnostic).

Stable API (the N1.6 and N1.7 policies build on it)::

    from loong.embodied.policies.groot import ActionHeadConfig, DiTConfig, SelfAttentionConfig, GrootActionHead

    head = GrootActionHead(ActionHeadConfig(..., dit=DiTConfig(...), vl_self_attention=SelfAttentionConfig(...)))
    head.set_trainable(tune_projector=..., tune_diffusion_model=..., tune_vlln=...)
    loss, metrics = head.loss(vl_tokens, state, actions, action_mask, embodiment_id,
                              vl_mask=..., image_mask=..., noise=None, time=None)
    actions = head.sample(vl_tokens, state, embodiment_id, vl_mask=..., image_mask=..., noise=None)
    head.blocks()          # the DiT blocks (FSDP units)

- ``vl_tokens`` ``[b, s, backbone_embedding_dim]``: the backbone's last hidden states (before vlln); ``vl_mask``
  ``[b, s]`` bool valid tokens; ``image_mask`` ``[b, s]`` bool image tokens (both needed by the alternate DiT).
- ``state`` ``[b, max_state_dim]`` or ``[b, history, max_state_dim]``; ``actions`` / ``action_mask`` ``[b,
  action_horizon, max_action_dim]``; ``embodiment_id`` ``[b]`` long in ``[0, num_embodiments)``.
- ``time`` ``[b]`` is GR00T's flow time (0 = noise, 1 = clean; see :mod:`.flow`); ``noise`` the Gaussian draw.
- N1.7: ``vl_self_attention.num_layers=4``, ``use_state_mask_token=False``. N1.6: ``vl_self_attention.num_layers
  =0`` (Identity), ``use_state_mask_token=True`` (Isaac-GR00T's ``mask_token``).
- Parameter names follow the published GR00T checkpoints: the head's ``state_dict()`` keys are those under
  ``action_head.`` in Isaac-GR00T / lerobot (``model.transformer_blocks.0.attn1.to_q.weight``, ...).

Lower-level pieces: :mod:`.dit` (``DiT``, ``SelfAttentionTransformer``, ``TransformerBlock``, ``Attention``,
``AdaLayerNorm``, ``TimestepEncoder``), :mod:`.embodiment` (``CategorySpecificLinear`` / ``MLP``,
``MultiEmbodimentActionEncoder``), :mod:`.flow` (``sample_time``, ``noisy_actions``, ``masked_velocity_loss``,
``euler_sample``).
"""

from loong.embodied.policies.groot.action_head import ActionHeadConfig, GrootActionHead
from loong.embodied.policies.groot.dit import DiT, DiTConfig, SelfAttentionConfig, SelfAttentionTransformer
from loong.embodied.policies.groot.embodiment import (
    CategorySpecificLinear,
    CategorySpecificMLP,
    MultiEmbodimentActionEncoder,
)

__all__ = [
    "ActionHeadConfig",
    "CategorySpecificLinear",
    "CategorySpecificMLP",
    "DiT",
    "DiTConfig",
    "GrootActionHead",
    "MultiEmbodimentActionEncoder",
    "SelfAttentionConfig",
    "SelfAttentionTransformer",
]
