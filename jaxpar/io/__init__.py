"""What a run reads and writes: datasets and batches, checkpoints, JSONL metrics and TensorBoard, reports."""
