"""What a run reports: step metrics (tokens/s, MFU, memory), the run dir's files, metrics.jsonl,
W&B. Imports config and engine.
"""
