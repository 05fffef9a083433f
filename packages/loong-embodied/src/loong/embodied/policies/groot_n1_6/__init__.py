"""GR00T N1.6 (NVIDIA Isaac-GR00T ``Gr00tN1d6``): Eagle 3 VL backbone + the GR00T flow-matching action head.

No installable package ships N1.6 (lerobot 0.6.1 has N1.5 / N1.7 only), so this policy follows the published
checkpoint layout of ``nvidia/GR00T-N1.6-3B`` as read from Isaac-GR00T's source (``gr00t/model/gr00t_n1d6/``,
``gr00t/model/modules/eagle_backbone.py`` and the Eagle-Block2A-2B-v2 model files): :mod:`.config` (published
defaults, presets ``tiny`` / ``groot_n1_6``), :mod:`.eagle` (the backbone from transformers' ``Siglip2VisionModel``
and ``Qwen3Model``), :mod:`.model` (the policy; the action head is the shared
:mod:`loong.embodied.policies.groot`), :mod:`.processor`, :mod:`.precompute` (the backbone's data-dependent
tensors, made by the processor so that the training step is capture-safe), :mod:`.checkpoint` (Loong names <->
published keys).

What is checked against an oracle (tests/test_groot_n1_6.py, CPU fp32, tiny random configs):

- the vision path equals transformers' ``Siglip2VisionModel`` run on the same weights with the SigLIP2 image
  processor's patch order, followed by ``F.pixel_unshuffle`` and the connector, written in the test as Eagle's
  ``extract_feature`` does it;
- the language path equals a deeper transformers ``Qwen3Model`` (same weights in its first ``select_layer``
  layers) whose ``hidden_states[select_layer]`` is passed through its final norm (GR00T's truncation), with the
  image features scattered at the image tokens;
- the N1.6 action head's DiT equals lerobot 0.6.1's ``AlternateVLDiT`` (the block family Isaac-GR00T's N1.6 uses:
  same ``dit.py`` blocks, 32 layers in N1.6 as in N1.7) on the same weights; the policy's loss (same seed, hence
  the same noise and time draws) and ``predict_action_chunk`` equal lerobot's ``GR00TN17ActionHead`` configured as
  N1.6 (``vl_self_attention`` 0 layers, state history 1, no state dropout) fed the policy's Eagle features -- at
  those settings Isaac-GR00T's ``Gr00tN1d6ActionHead.forward`` / ``get_action`` compute the same thing;
- the capture-safe step (tests/test_groot16_capture_safe.py): no device sync nor host data in forward + backward,
  and the loss and every gradient equal the former forward's (transformers' own SigLIP2 resize, ``masked_scatter``,
  ``Qwen3Model``'s own mask) bit for bit;
- the checkpoint mapping round-trips bit-exactly, and a synthetic folder written under the published key names
  (listed independently in the test from the published module tree, with the unused ``lm_head`` and pooling
  head, sharded, bf16) loads.

Not covered by an oracle: Isaac-GR00T itself (not installable here; its SigLIP2 fork with use_rope / windows off
and flash-attention packing is argued equal to transformers' in :mod:`.eagle`, not run), the N1.6-only head paths
(the ``mask_token`` state dropout when ``state_dropout_prob > 0``, which lerobot's N1.7 head does differently;
``state_additive_noise_scale`` and real-time chunking are not implemented), the exact Jinja chat template text of
the Eagle tokenizer (the prompt follows the Eagle processor's ``py_apply_chat_template``), Isaac-GR00T's image
resizing / augmentations, and the real 3B weights (no downloads). The ``groot_n1_6`` preset's parameter count is
checked on the meta device against a count computed from the published config (2,960,729,840; with the unused
``lm_head`` and pooling head, 3.29e9 x 2 bytes = the published folder's 6.57 GB).
"""

from loong.embodied.policies.base import PolicySpec
from loong.embodied.policies.groot_n1_6.config import PRESETS, GrootN16Config
from loong.embodied.policies.groot_n1_6.model import GrootN16Policy
from loong.embodied.policies.groot_n1_6.processor import GrootN16Processor

SPEC = PolicySpec(name="groot_n1_6", config_class=GrootN16Config, policy_class=GrootN16Policy,
                  processor_class=GrootN16Processor, presets=PRESETS, lerobot=None)

__all__ = ["SPEC", "GrootN16Config", "GrootN16Policy", "GrootN16Processor"]
