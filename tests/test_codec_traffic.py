"""Realistic traffic (torchrec_lossy.traffic): round trip within bounds and the ratio target."""

from __future__ import annotations

import pytest
import torch

from torchrec_lossy.codec import compress_with_stats, decompress
from torchrec_lossy.traffic import (
    DEFAULT_CRITEO_SAMPLE,
    TrafficSpec,
    make_blocks,
    paper_traffic,
    relative_to_absolute_bounds,
)

TARGET_RATIO = 18.0  # the project's target on realistic traffic (total raw / total wire bytes)


def _check(spec: TrafficSpec) -> float:
    blocks, bounds = paper_traffic(spec)
    payload, stats = compress_with_stats(blocks, bounds)
    assert payload.numel() == 32 + sum(s.wire_bytes for s in stats)
    out = decompress(payload)
    for i, (x, y, b, s) in enumerate(zip(blocks, out, bounds, stats, strict=True)):
        assert y.shape == x.shape and y.dtype == x.dtype
        err = float((x.double() - y.double()).abs().max())
        assert err <= b, f"table {i}: max error {err} > bound {b}"
        assert s.max_error == err
        assert s.wire_bytes < s.raw_bytes, f"table {i} ({s.mode}) did not compress"
    raw = sum(x.numel() * x.element_size() for x in blocks)
    return raw / payload.numel()


def test_kaggle_traffic_meets_the_ratio_target():
    ratio = _check(TrafficSpec(batch_rows=1024))
    assert ratio >= TARGET_RATIO, f"overall ratio {ratio:.2f} < {TARGET_RATIO}"


def test_1tb_traffic_meets_the_ratio_target():
    ratio = _check(TrafficSpec(preset="criteo_1tb", dim=64, batch_rows=1024, seed=3, batch=2))
    assert ratio >= TARGET_RATIO, f"overall ratio {ratio:.2f} < {TARGET_RATIO}"


@pytest.mark.skipif(not DEFAULT_CRITEO_SAMPLE.is_file(), reason="shared Criteo sample not found")
def test_real_criteo_ids_round_trip():
    ratio = _check(TrafficSpec(preset="criteo_1tb", batch_rows=1000, source="criteo"))
    assert ratio >= TARGET_RATIO, f"overall ratio {ratio:.2f} < {TARGET_RATIO}"


def test_tighter_bounds_cost_more_bytes():
    blocks = make_blocks(TrafficSpec(batch_rows=256))
    sizes = []
    for rel in (0.05, 0.01, 0.001, 0.0):
        bounds = relative_to_absolute_bounds(blocks, rel)
        payload, _ = compress_with_stats(blocks, bounds)
        sizes.append(payload.numel())
        if rel == 0.0:
            assert all(
                torch.equal(x.view(torch.int32), y.view(torch.int32))
                for x, y in zip(blocks, decompress(payload), strict=True)
            )
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
