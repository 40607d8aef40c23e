"""Host side: PCIe copies and the CPU optimizer. Seconds."""
from __future__ import annotations

import numpy as np


def host_copy_time_s(bytes_moved, pcie_bytes_per_s: float):
    """H2D or D2H copy on one GPU's host link (the configured figure is measured with every GPU of
    the node copying at once, so concurrent copies of the node's GPUs are already in it)."""
    return np.asarray(bytes_moved, dtype=np.float64) / pcie_bytes_per_s


def cpu_adam_time_s(params_per_gpu, gpus_per_node: int, cpu_adam_params_per_s: float):
    """Host Adam over each GPU's offloaded parameters; the node's GPUs share its CPU."""
    return np.asarray(params_per_gpu, dtype=np.float64) * gpus_per_node / cpu_adam_params_per_s
