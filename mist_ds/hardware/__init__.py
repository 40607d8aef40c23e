"""Hardware model: how long compute, collectives, p2p and host copies take, and how they interfere."""
from mist_ds.hardware.model import HardwareModel, hardware_model

__all__ = ["HardwareModel", "hardware_model"]
