"""Text data: tokenizers, on-the-fly tokenisation and packing to fixed-length samples."""
