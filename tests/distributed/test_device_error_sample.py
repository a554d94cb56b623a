"""The sender's error sample and ``comms.guard`` on the device path (issue 32), run on CPU
through the codec's ``"reference"`` backend (the device orchestration over the kernels' torch
twins, the path a GPU runs).

Each call is driven as the exchange drives it (``start_encode``, the one ``read_checked`` of the
size exchange, ``finish``): the device path decodes its own payloads and sums their errors on
the device, reads nothing of its own, and its sums ride the module's next host read. The values
it records are the host path's for the same blocks, and the guard tightens the adversarial
table as on the host path, one read later.
"""

from __future__ import annotations

import math

import pytest
import torch

from torchrec_lossy.codec import CodecConfig, host_sync
from torchrec_lossy.config import ErrorBound, GuardConfig, LossyCommsConfig
from torchrec_lossy.distributed import BlockSpec, LossyComms, StaticBounds
from torchrec_lossy.distributed.call_ledger import CallLedger, read_checked
from torchrec_lossy.distributed.guard import BoundGuard
from torchrec_lossy.distributed.pooled_blocks import LossyAll2AllPooledInfo
from torchrec_lossy.distributed.pooled_payload import start_encode
from torchrec_lossy.distributed.stats import ErrorAlert, LossyCommsStats

TABLES = ["t_bad", "t_good"]
# Per peer: t_bad with 2 features of width 8, t_good with 1 of width 4.
SPECS = (BlockSpec("t_bad", 0, 2, 8), BlockSpec("t_good", 16, 1, 4))
ROWS = 24  # rows per feature and peer


def _info(
    backend: str, bound: ErrorBound, guard: GuardConfig | None = None
) -> LossyAll2AllPooledInfo:
    config = LossyCommsConfig(
        # Packed codes: a small coded block stays smaller than raw at every tightening.
        codec=CodecConfig(backend=backend, format="packed"),
        backward_bound=bound,
        error_sample_every=1,
        guard=guard or GuardConfig(),
    )
    comms = LossyComms(
        config=config,
        bounds=StaticBounds(TABLES, config),
        guard=BoundGuard(TABLES, config.guard) if config.guard.enabled else None,
    )
    return LossyAll2AllPooledInfo(
        batch_size_per_rank=[ROWS, ROWS],
        layout=[SPECS, SPECS],
        comms=comms,
        ledger=CallLedger(),
        compress=comms.compress_flags(TABLES),
    )


def _gradients(seed: int, nonfinite: bool = False) -> list[list[torch.Tensor]]:
    """Two peers' gradient blocks: t_bad's rows at scales spanning six decades, t_good's
    homogeneous (with a NaN and an Inf in t_bad when ``nonfinite``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        bad = 0.03 * torch.randn(2 * ROWS, 8, generator=g)
        bad = bad * 10 ** (-6 * torch.rand(2 * ROWS, 1, generator=g))
        if nonfinite:
            bad[3, 5], bad[7, 0] = math.nan, -math.inf
        out.append([bad, 0.03 * torch.randn(ROWS, 4, generator=g)])
    return out


def _call(info: LossyAll2AllPooledInfo, blocks: list[list[torch.Tensor]]) -> int:
    """One backward all-to-all's encode as the exchange drives it; returns its host reads."""
    before = host_sync.host_reads()
    record = info.ledger.start("bwd")
    pending = start_encode("bwd", blocks, [SPECS, SPECS], info, torch.device("cpu"), record=record)
    host = read_checked(info.ledger, pending.readback)  # the size exchange's one read
    pending.finish(host.tolist())
    pending.telemetry.write(info.comms.stats)
    return host_sync.host_reads() - before


def _alerts(stats: LossyCommsStats) -> list[tuple]:
    return [
        (a.direction, a.table, a.call, a.nonfinite, a.past_level, a.level) for a in stats.alerts()
    ]


def test_device_sample_records_the_host_values_at_the_next_read_with_no_read_of_its_own() -> None:
    bound = ErrorBound("relative", 0.01)  # block-relative: t_bad's small rows pass the level
    host, device = _info("cpu", bound), _info("reference", bound)
    blocks = _gradients(0, nonfinite=True)
    _call(host, blocks)
    assert _call(device, blocks) == 1  # the exchange's read only: the sample reads nothing
    hs, ds = host.comms.stats, device.comms.stats
    # Until the next host read the sample is on the device: nothing recorded yet.
    assert ds.table("t_bad", "bwd").error_count == 0 and ds.alerts() == []
    before = host_sync.host_reads()
    read_checked(device.ledger)  # the next read (here check_lossy_decodes' own)
    assert host_sync.host_reads() - before == 1
    for t in TABLES:
        h, d = hs.table(t, "bwd"), ds.table(t, "bwd")
        assert h.wire_bytes == d.wire_bytes > 0  # the same payloads
        assert h.error_count > 0
        for name in ("error_count", "snapped_to_zero", "error_rows", "nonfinite"):
            assert getattr(d, name) == getattr(h, name), (t, name)
        for name in ("error_sum", "error_sq_sum", "value_sq_sum", "row_rel_sq_sum"):
            got, want = getattr(d, name), getattr(h, name)
            assert got == pytest.approx(want, rel=1e-9, abs=1e-300), (t, name)
    assert hs.table("t_bad", "bwd").nonfinite == 4  # two per peer
    # One alert per sampled block (t_bad's, one per peer), past the level and with its NaN/Inf.
    assert _alerts(ds) == _alerts(hs) == [("bwd", "t_bad", 0, 2, True, 0)] * 2
    for h_alert, d_alert in zip(hs.alerts(), ds.alerts(), strict=True):
        assert isinstance(d_alert, ErrorAlert)
        assert d_alert.row_energy == pytest.approx(h_alert.row_energy, rel=1e-9)
    read_checked(device.ledger)  # nothing owed any more: no read, nothing recorded twice
    assert ds.table("t_bad", "bwd").error_count == hs.table("t_bad", "bwd").error_count


def test_guard_tightens_on_the_device_path_as_on_the_host_path_one_read_later() -> None:
    bound = ErrorBound("absolute", 1e-3)  # the user's: six decades of rows pass the level
    guard = GuardConfig(enabled=True, factor=0.5, max_tightenings=3, check_every=1)
    runs = {b: _info(b, bound, guard) for b in ("cpu", "reference")}
    errors: dict[str, list[float]] = {b: [] for b in runs}
    for step in range(10):
        blocks = _gradients(100 + step)
        for backend, info in runs.items():
            stats = info.comms.stats
            stats.reset()
            assert _call(info, blocks) == 1
            errors[backend].append(stats.table("t_bad", "bwd").max_error)
            assert info.comms.guard is not None
            info.comms.guard.step(stats, None)  # step_lossy_bounds' part
    events = {
        b: [(e.step, e.table, e.level, e.factor) for e in info.comms.guard.events]  # type: ignore[union-attr]
        for b, info in runs.items()
    }
    # Host: a step's alert is checked at its end, applied at the next; the step after a
    # tightening still encodes at the old bound (no evidence), the one after alerts anew.
    assert events["cpu"] == [(2, "t_bad", 1, 0.5), (4, "t_bad", 2, 0.25), (6, "t_bad", 3, 0.0)]
    # Device: the same tightenings, each a read later (its sample is read by the next call),
    # and the late samples from the old bound are no evidence against the new one.
    assert events["reference"] == [
        (3, "t_bad", 1, 0.5), (6, "t_bad", 2, 0.25), (9, "t_bad", 3, 0.0),
    ]  # fmt: skip
    # Every step met the bound in force when it was encoded (steps are 1-based in events).
    for backend, levels in (("cpu", [0, 0, 1, 1, 2, 2, 3, 3, 3, 3]),
                            ("reference", [0, 0, 0, 1, 1, 1, 2, 2, 2, 3])):  # fmt: skip
        for step, (err, k) in enumerate(zip(errors[backend], levels, strict=True)):
            limit = 0.0 if k == 3 else 1e-3 * 0.5**k
            assert err <= limit * (1 + 1e-6), (backend, step, err, limit)
            if k < 3:
                assert err > 0.5 * limit  # lossy at the bound in force (not exact already)
    for info in runs.values():  # t_good never passed the level
        assert info.comms.guard is not None and info.comms.guard.level("bwd", "t_good") == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: sync debug mode")
def test_cuda_device_sample_syncs_only_in_the_exchange_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA the sampled call syncs only in the one counted read (``host_sync.to_host``),
    and the sample recorded at the next read is the host path's."""
    from helpers import cuda_syncs_only_in_to_host

    bound = ErrorBound("relative", 0.01)
    host, device = _info("cpu", bound), _info("auto", bound)
    blocks = _gradients(0, nonfinite=True)
    cuda = [[b.cuda() for b in per_peer] for per_peer in blocks]
    _call(host, blocks)
    _call(_info("auto", bound), cuda)  # compile first

    def call() -> None:
        record = device.ledger.start("bwd")
        pending = start_encode(
            "bwd", cuda, [SPECS, SPECS], device, cuda[0][0].device, record=record
        )
        pending.finish(read_checked(device.ledger, pending.readback).tolist())

    with cuda_syncs_only_in_to_host(monkeypatch):
        before = host_sync.host_reads()
        call()
        assert host_sync.host_reads() - before == 1
    read_checked(device.ledger)
    for t in TABLES:
        h, d = host.comms.stats.table(t, "bwd"), device.comms.stats.table(t, "bwd")
        assert d.error_count == h.error_count > 0
        assert d.row_rel_sq_sum == pytest.approx(h.row_rel_sq_sum, rel=1e-9)


def test_device_sums_are_the_host_pass_on_edge_blocks() -> None:
    """``start_device_sample`` against the host pass on one payload's odd blocks: no rows, no
    columns, float16, all-zero rows, NaN / Inf, a row at 3e38 among small ones."""
    from torchrec_lossy.codec import compress_groups
    from torchrec_lossy.codec.bounds import BoundKind
    from torchrec_lossy.distributed import error_sample

    g = torch.Generator().manual_seed(3)
    odd = torch.randn(40, 6, generator=g)
    odd[::5] = 0.0
    odd[3, 2], odd[7, 0], odd[11, :] = math.nan, math.inf, 3e38
    blocks = [
        torch.zeros(0, 8), torch.zeros(4, 0), (torch.randn(30, 4, generator=g) * 5).half(), odd,
        torch.randn(50, 8, generator=g) * 10 ** (-8 * torch.rand(50, 1, generator=g)),
    ]  # fmt: skip
    tables = [f"t{i}" for i in range(len(blocks))]
    for kind, bound in ((BoundKind.RELATIVE, 0.01), (BoundKind.VALUE, 1 / 32)):
        kinds = [[kind] * len(blocks)]
        host = compress_groups([blocks], [[bound] * len(blocks)], CodecConfig(), kinds)
        dev = compress_groups(
            [blocks], [[bound] * len(blocks)], CodecConfig(backend="reference"), kinds
        )
        hs, ds = LossyCommsStats(), LossyCommsStats()
        error_sample.record_error_samples(hs, "bwd", host.payload(0), blocks, tables, 2)
        sample = error_sample.start_device_sample(
            ds, "bwd", dev.buffer, dev.sizes, dev.skeletons, [blocks], tables, 2, [0] * 5,
            "reference",
        )  # fmt: skip
        sample.raise_if_failed(host_sync.to_host(sample.flags).tolist())
        for t in tables:
            h, d = hs.table(t, "bwd"), ds.table(t, "bwd")
            for name in ("error_count", "snapped_to_zero", "error_rows", "nonfinite"):
                assert getattr(d, name) == getattr(h, name), (kind, t, name)
            for name in ("error_sum", "error_sq_sum", "value_sq_sum", "row_rel_sq_sum"):
                assert getattr(d, name) == pytest.approx(getattr(h, name), rel=1e-9, abs=1e-300)
        assert hs.table("t3", "bwd").nonfinite == 2
        assert _alerts(ds) == _alerts(hs)
