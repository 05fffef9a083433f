"""The ``model`` config group: one file per Wan preset (``model=NAME``)."""
