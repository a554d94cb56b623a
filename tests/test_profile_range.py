"""``profile_range``: the library's profiler ranges, opened only while a profiler records."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from torchrec_lossy.profile_range import profile_range


def test_ranges_are_recorded_under_a_profiler_and_skipped_without() -> None:
    # The flag profile_range reads: this fails if torch renames it (every range would then be
    # recorded again, which is correct but costs its op dispatch in every training step).
    assert torch.autograd.profiler._is_profiler_enabled is False
    assert not isinstance(profile_range("## lossy_test ##"), record_function)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert isinstance(profile_range("## lossy_test ##"), record_function)
        with profile_range("## lossy_test range ##"):
            torch.ones(2).add_(1)
    assert "## lossy_test range ##" in {e.name for e in prof.events()}
    assert not isinstance(profile_range("## lossy_test ##"), record_function)  # stopped: off
