"""Data of loong-embodied: the synthetic reach task's LeRobotDataset (:mod:`.synthetic`), the training reader over
any local LeRobotDataset v3 folder (:mod:`.dataset`) and normalisation from its statistics (:mod:`.normalize`); a
weighted mix of several folders tagged by embodiment (:mod:`.mix`), its seeded, resumable, DP-sharded sample
stream (:mod:`.sampler`) and the training loader with workers and device prefetch (:mod:`.loader`).
Each imports lerobot only when called, so importing them is cheap."""
