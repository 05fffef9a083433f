"""Packaged Hydra configs of ``loong-embodied train``: ``train.yaml`` and the ``policy`` group (one option per
policy preset)."""
