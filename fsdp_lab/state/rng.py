"""Each rank's random number generators, saved with a checkpoint and restored on resume (same
world size only): torch's, numpy's, Python's and the device's."""

from __future__ import annotations

import random

import numpy as np
import torch

from fsdp_lab.engine.hardware import devices


def rng_state(device: torch.device) -> dict:
    """Every RNG state as tensors and plain containers (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "python": [version, list(py_state), py_gauss],
        "device": devices.device_rng_state(device),
    }


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, py_state, py_gauss = state["python"]
    random.setstate((version, tuple(py_state), py_gauss))
    devices.set_device_rng_state(device, state["device"])
