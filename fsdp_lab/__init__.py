"""fsdp_lab: Hydra-configured FSDP2 experiments on Hugging Face models."""

import logging as _logging

from fsdp_lab.internals import PYTREE_LOGGER as _PYTREE_LOGGER


def _quiet_torchao_import() -> None:
    """transformers imports torchao wherever it is installed (the torchao extra, which dev
    includes); on a host without its CUDA extensions or Triton torchao warns about each at
    import, and torch about the enums it registers. True, and no concern of a run's: float8 and
    NF4 need neither. Only those messages are dropped."""

    class _Drop(_logging.Filter):
        def filter(self, record: _logging.LogRecord) -> bool:
            message = record.getMessage()
            return not (
                message.startswith(("Failed to load", "Warning: Detected no triton"))
                or "is an Enum subclass and is now natively supported" in message
            )

    for name in ("torchao", "torchao.kernel.intmm", _PYTREE_LOGGER):
        _logging.getLogger(name).addFilter(_Drop())


_quiet_torchao_import()
