"""What a run shows and records: ``metrics.jsonl``, experiment trackers (TensorBoard, W&B) and the progress
line."""
