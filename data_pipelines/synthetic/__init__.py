"""Synthetic tasks that need tools, deterministic given a seed, with gold trajectories for SFT."""
