"""What a run reports: step metrics (tokens/s, MFU, memory), the run dir's files, metrics.jsonl,
the trackers (W&B, TensorBoard, MLflow). Imports config and engine.
"""
