"""Hydra finds sweepers only under ``hydra_plugins``: this is fsdp_lab's Optuna study there
(``hydra/sweeper=study``, conf/hydra/sweeper/study.yaml). The work is in
``fsdp_lab.launch.study``, imported when a study starts so that every other run skips Optuna."""

from __future__ import annotations

from typing import Any

from hydra.plugins.sweeper import Sweeper


class StudySweeper(Sweeper):
    def __init__(self, **params: Any) -> None:
        try:
            from fsdp_lab.launch.study import StudySweeper as Impl
        except ImportError as e:
            raise ImportError(
                f"hydra/sweeper=study needs Optuna's Hydra sweeper ({e}): "
                "pip install -e '.[optuna]'"
            ) from e
        self.sweeper = Impl(**params)

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.sweeper.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        return self.sweeper.sweep(arguments)
