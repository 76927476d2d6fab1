"""`fsdp-lab data prepare OVERRIDES...`: a run's corpus tokenised into the cache, without a run.

Prepare before the run that needs it: on a CPU node before a GPU job, or before a job of many
nodes, whose ranks would otherwise wait for rank 0 to prepare it (at most 2 hours, the solo-work
timeout). The checks are the launcher's own, so a corpus this command prepared is the one the
run finds: the same overrides give the same cache entry.
"""

from __future__ import annotations

import logging
import sys

from fsdp_lab.config import ConfigError, DataKind
from fsdp_lab.config.rules import validate
from fsdp_lab.launch.prepare import check_model_and_data
from fsdp_lab.tools.plan import compose, topology


def prepare_command(overrides: list[str]) -> int:
    """Prepare the corpus ``overrides`` describe (its progress and last line on stderr)."""
    cfg = compose(overrides)
    if cfg.data.kind is DataKind.synthetic:
        raise ConfigError(
            "data=synthetic is made as it is read: nothing to prepare; set data=text (or hub, "
            "shakespeare, tokens) and its files"
        )
    logger = logging.getLogger("fsdp_lab")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    topo, _ = topology(cfg)
    validate(cfg, topo)
    check_model_and_data(cfg, topo)
    return 0
