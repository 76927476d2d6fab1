"""What outlives a run: checkpoints (distributed, atomic, checksummed) and the Hugging Face export.
Imports config and engine.
"""
