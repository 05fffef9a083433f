"""The ``policy`` config group: one file per policy preset (``policy=NAME``), each setting ``model.policy`` and
``model.preset`` (and, for the tiny CPU presets, the reach task's chunk)."""
