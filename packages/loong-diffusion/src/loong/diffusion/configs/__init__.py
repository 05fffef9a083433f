"""Packaged Hydra configs of ``loong-diffusion train``: ``train.yaml`` and the ``model`` group (Wan presets)."""
