"""The only package that names cuda or xla (with ``engine.xla``, the other importer of
torch_xla, only on hardware=tpu): the GPU and TPU paths differ from the tested CPU path only
here. A test holds the other modules to it (tests/unit/test_layers.py); the host ("cpu") is
named wherever a tensor moves to host memory.

One module per concern; callers import the module that owns what they use:

- ``devices``: the device a run has and what it can run, checked before launch (kind, ranks
  per node, dtypes, experts kernels, compile, threads); each rank's device, its random state,
  batches moved onto it, waiting for it and timing steps on it; the device in one line.
- ``process_group``: the backend, joining the group, where the collectives' small tensors
  live, gathering from every process, waiting out rank 0's solo work, the flight recorder.
- ``memory``: host and device memory: glibc's heap, pinned memory, peak and current readings,
  and the profiler's (what it records, the allocator's history, the out-of-memory observer).
- ``flops``: peak FLOP/s of a device for MFU, and TF32 (which column of the table applies).
"""
