"""Model families of loong-diffusion, one folder each (its config and presets, modules and diffusers mapping)."""
