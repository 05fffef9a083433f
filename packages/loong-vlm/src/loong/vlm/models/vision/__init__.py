"""What the vision encoders and projectors of loong-vlm share (:mod:`.common`): their output dataclasses, the
attention block over packed images (varlen documents per frame or window), MLPs, norms, the Qwen 2-D RoPE, the
declared HF key-mapping helper and the ViT FLOPs model."""
