"""Hydra search-path plugin: lets any Hydra app compose mist_ds's `model=` and `cluster=` groups."""
