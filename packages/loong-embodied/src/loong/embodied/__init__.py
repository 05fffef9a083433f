"""Loong embodied: vision-language-action policies (Pi0.5, GR00T N1.6) and LeRobot datasets."""

__version__ = "0.1.0.dev0"
