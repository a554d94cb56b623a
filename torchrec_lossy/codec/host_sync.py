"""The device paths' one way to read a tensor back to the host, counted.

Every device-to-host copy the device-resident codec makes goes through :func:`to_host`, so a test
can count them (:func:`host_reads`) and a CUDA run can allow syncs there only
(``torch.cuda.set_sync_debug_mode("error")`` lifted inside it).
"""

from __future__ import annotations

import numpy as np
import torch

# Copies made since the process started, by caller ("" for all).
_COUNTS: dict[str, int] = {"": 0}


def to_host(t: torch.Tensor, who: str = "") -> np.ndarray:
    """Copies a tensor to host memory (one sync for a CUDA tensor) and counts the copy.

    Args:
        t: A tensor on any device.
        who: The caller's name, counted apart as well (e.g. ``"decompress"``).

    Returns:
        Its contents as a numpy array.
    """
    _COUNTS[""] += 1
    if who:
        _COUNTS[who] = _COUNTS.get(who, 0) + 1
    return t.detach().contiguous().cpu().numpy()


def host_reads(who: str = "") -> int:
    """Device-to-host copies made by the device-resident codec since the process started.

    Args:
        who: Only this caller's copies; "" for all.

    Returns:
        The count.
    """
    return _COUNTS.get(who, 0)
