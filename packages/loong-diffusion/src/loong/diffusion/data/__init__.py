"""Training data of loong-diffusion: the synthetic "moving shapes" set (:mod:`.synthetic`) and the shards of
``loong-diffusion preprocess`` (:mod:`.shards`)."""
