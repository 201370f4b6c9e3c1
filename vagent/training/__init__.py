"""Training infrastructure: distributed setup, optimizer and schedule, train backends (DDP, DeepSpeed),
atomic checkpoints with exact resume, metrics logging, and the SFT dataset."""
