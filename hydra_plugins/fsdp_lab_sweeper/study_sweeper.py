"""Hydra finds sweepers only under ``hydra_plugins``: this registers fsdp_lab's
(``fsdp_lab.launch.study_sweeper``) and holds no code of its own. Hydra's scan takes every
Sweeper class among this module's names."""

from fsdp_lab.launch.study_settings import register
from fsdp_lab.launch.study_sweeper import StudySweeper

register()

__all__ = ["StudySweeper"]
