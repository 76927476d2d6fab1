"""``python -m fsdp_lab OVERRIDES...``: the training command, as ``python train.py`` runs it in
a checkout (``fsdp_lab.launch.command``)."""

import sys

from fsdp_lab.launch.command import main

if __name__ == "__main__":
    sys.exit(main())
