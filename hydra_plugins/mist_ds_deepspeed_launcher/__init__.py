"""Hydra launcher plugin: each job of a sweep is a DeepSpeed launch of the swept training script."""
