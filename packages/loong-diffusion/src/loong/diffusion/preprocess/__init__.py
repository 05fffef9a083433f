"""``loong-diffusion preprocess``: videos / images + captions (a JSONL manifest) → shards of VAE latents and text
embeddings for training (``data.source=shards``).

:mod:`.manifest` reads the rows, :mod:`.buckets` decides each clip's shape, :mod:`.media` decodes and cuts it,
:mod:`.encode` runs the VAE and text encoder, :mod:`.image_encoder` the image-to-video condition's frames and
their CLIP features, :mod:`.writer` commits shards atomically and resumably, and
:mod:`.run` drives them.
"""

from loong.diffusion.preprocess.run import preprocess

__all__ = ["preprocess"]
