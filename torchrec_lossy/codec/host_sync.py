"""The device paths' transfers between host and device: reads counted, uploads without a sync.

Every device-to-host copy the device-resident codec makes goes through :func:`to_host`, so a test
can count them (:func:`host_reads`) and a CUDA run can allow syncs there only
(``torch.cuda.set_sync_debug_mode("error")`` lifted inside it). Host tables go the other way as
records (:func:`upload_record`): one non-blocking copy for all their fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from torchrec_lossy.codec.container import upload

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


def upload_record(record: Any, device: torch.device) -> Any:
    """A dataclass of 1-D host integer arrays, as the same dataclass of int64 tensors on
    ``device``, in one non-blocking copy (``container.upload``: pinned on CUDA, no sync).

    Args:
        record: A dataclass instance whose fields are all 1-D integer arrays.
        device: Target device.

    Returns:
        ``type(record)`` with every field a tensor (views of one buffer).
    """
    names = [f.name for f in dataclasses.fields(record)]
    tensors = upload([getattr(record, n) for n in names], device)
    return type(record)(**dict(zip(names, tensors, strict=True)))
