"""Data of loong-embodied: the synthetic reach task's LeRobotDataset (:mod:`.synthetic`), the training reader over
any local LeRobotDataset v3 folder (:mod:`.dataset`) and normalisation from its statistics (:mod:`.normalize`).
Each imports lerobot only when called, so importing them is cheap."""
