"""The `fsdp-lab` commands: plan, report, export, from-accelerate. Imports any package."""
