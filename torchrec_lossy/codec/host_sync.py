"""The device paths' one way to read a tensor back to the host, counted.

Every device-to-host copy the device-resident codec makes goes through :func:`to_host`, so a test
can count them (:func:`host_reads`) and a CUDA run can allow syncs there only
(``torch.cuda.set_sync_debug_mode("error")`` lifted inside it).
"""

from __future__ import annotations

import numpy as np
import torch


class _Counter:
    """How many copies :func:`to_host` made since the process started."""

    count = 0


def to_host(t: torch.Tensor) -> np.ndarray:
    """Copies a tensor to host memory (one sync for a CUDA tensor) and counts the copy.

    Args:
        t: A tensor on any device.

    Returns:
        Its contents as a numpy array.
    """
    _Counter.count += 1
    return t.detach().contiguous().cpu().numpy()


def host_reads() -> int:
    """Device-to-host copies made by the device-resident codec since the process started.

    Returns:
        The count.
    """
    return _Counter.count
