"""Loong diffusion: DiT families (Wan 2.x), latent video data and flow matching."""

__version__ = "0.1.0.dev0"
