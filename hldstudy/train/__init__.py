"""Trainer: mesh, optimizer, steps, checkpoints, metrics, loop."""
