"""Hydra finds sweepers only under ``hydra_plugins`` and instantiates only classes defined
there: this registers fsdp_lab's study sweeper (``hydra/sweeper=study``) under that name. The
code and the settings' schema are ``fsdp_lab.launch.study_sweeper`` and ``study_settings``."""

from fsdp_lab.launch import study_settings, study_sweeper

study_settings.register()


class StudySweeper(study_sweeper.StudySweeper):
    """``fsdp_lab.launch.study_sweeper.StudySweeper``, where Hydra looks for it."""
