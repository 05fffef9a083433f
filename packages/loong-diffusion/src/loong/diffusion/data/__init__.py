"""Training data of loong-diffusion: for now the synthetic "moving shapes" set (:mod:`.synthetic`)."""
