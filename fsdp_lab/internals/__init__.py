"""The one door to torch's and transformers' private names: ``torch_private`` and
``transformers_private``, each use with the public API it waits for. Nothing else in fsdp_lab
names a private attribute or module of either library (tests/unit/test_structure.py), so an
upgrade that moves one breaks here, where ``check()`` names it (tests/unit/test_internals.py).
Imports nothing of fsdp_lab; this file imports nothing at all (fsdp_lab's own __init__ reads
it before any torch)."""

# torch's pytree module warns through its logger when torchao registers enums (quieted).
PYTREE_LOGGER = "torch.utils._pytree"
