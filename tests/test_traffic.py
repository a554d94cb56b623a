"""Tests of the realistic traffic generator (torchrec_lossy.traffic)."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import pytest
import torch

from torchrec_lossy.cardinalities import CRITEO_1TB_CARDINALITIES, CRITEO_KAGGLE_CARDINALITIES
from torchrec_lossy.traffic import (
    DEFAULT_CRITEO_SAMPLE,
    TrafficSpec,
    ValueModel,
    criteo_sample_ids,
    embedding_rows,
    frequency_ranks,
    make_blocks,
    paper_class_bounds,
    relative_to_absolute_bounds,
    sample_ids,
    table_cardinalities,
    zipf_alpha,
    zipf_pmf,
)

needs_sample = pytest.mark.skipif(
    not DEFAULT_CRITEO_SAMPLE.is_file(),
    reason=f"shared Criteo sample not found at {DEFAULT_CRITEO_SAMPLE}",
)


def _mean_distinct(cardinality: int, rows: int = 2048, batches: int = 16) -> float:
    gen = torch.Generator().manual_seed(1234)
    counts = [sample_ids(cardinality, rows, gen).unique().numel() for _ in range(batches)]
    return sum(counts) / batches


def test_presets() -> None:
    assert table_cardinalities("criteo_kaggle") == list(CRITEO_KAGGLE_CARDINALITIES)
    assert table_cardinalities("criteo_1tb") == list(CRITEO_1TB_CARDINALITIES)
    assert len(CRITEO_KAGGLE_CARDINALITIES) == len(CRITEO_1TB_CARDINALITIES) == 26
    assert max(CRITEO_1TB_CARDINALITIES) == 40_000_000
    with pytest.raises(ValueError, match="unknown preset"):
        table_cardinalities("criteo")


@pytest.mark.parametrize(
    ("preset", "dim", "rows"), [("criteo_kaggle", 32, 256), ("criteo_1tb", 64, 100)]
)
def test_make_blocks_shapes_and_determinism(preset: str, dim: int, rows: int) -> None:
    spec = TrafficSpec(preset=preset, dim=dim, batch_rows=rows, seed=3)
    blocks = make_blocks(spec)
    assert len(blocks) == 26
    for b in blocks:
        assert b.shape == (rows, dim)
        assert b.dtype == torch.float32
        assert bool(torch.isfinite(b).all())
    again = make_blocks(spec)
    assert all(torch.equal(a, b) for a, b in zip(blocks, again, strict=True))
    other_seed = make_blocks(TrafficSpec(preset=preset, dim=dim, batch_rows=rows, seed=4))
    assert not torch.equal(blocks[0], other_seed[0])


def test_rows_depend_only_on_seed_table_and_id() -> None:
    card = 10_131_227
    ids = torch.tensor([7, 123_456, 7, 9_999_999, 0])
    rows = embedding_rows(2, ids, 32, card, seed=5)
    assert torch.equal(rows[0], rows[2])
    alone = embedding_rows(2, torch.tensor([9_999_999]), 32, card, seed=5)
    assert torch.equal(alone[0], rows[3])
    assert not torch.equal(embedding_rows(3, ids, 32, card, seed=5), rows)
    assert not torch.equal(embedding_rows(2, ids, 32, card, seed=6), rows)
    with pytest.raises(ValueError, match="ids must lie"):
        embedding_rows(2, torch.tensor([card]), 32, card)


def test_batches_differ_in_ids_not_in_rows() -> None:
    a = make_blocks(TrafficSpec(batch_rows=64, batch=0))
    b = make_blocks(TrafficSpec(batch_rows=64, batch=1))
    assert not torch.equal(a[2], b[2])
    # The 3-row table has at most 3 distinct rows, shared by both batches.
    assert {tuple(r.tolist()) for r in b[8]} <= {tuple(r.tolist()) for r in a[8]} | {
        tuple(r.tolist()) for r in embedding_rows(8, torch.arange(3), 32, 3)
    }


def test_skew_calibration_facts() -> None:
    # DESIGN §1: a 3-row table gives 2 distinct vectors in a 2,048-row batch; a 36K-row table
    # about 945.
    assert 1.8 <= _mean_distinct(3) <= 2.5
    assert 880 <= _mean_distinct(36_000) <= 1010
    assert zipf_alpha(3) == pytest.approx(9.0, abs=0.01)
    assert zipf_alpha(36_000) == pytest.approx(1.042, abs=0.002)


def test_small_tables_more_skewed_than_large() -> None:
    cards = [4, 63, 1_460, 36_000, 2_202_608, 40_000_000]
    alphas = [zipf_alpha(c) for c in cards]
    assert alphas == sorted(alphas, reverse=True)
    assert all(a > 1.0 for a in alphas)
    fractions = [_mean_distinct(c, batches=4) / min(c, 2048) for c in cards[2:]]
    assert fractions == sorted(fractions)


@pytest.mark.parametrize("card", [1, 2, 10, 70_000, 40_000_000])
def test_sample_ids_range(card: int) -> None:
    ids = sample_ids(card, 20_000, torch.Generator().manual_seed(0))
    assert ids.dtype == torch.int64
    assert ids.shape == (20_000,)
    assert int(ids.min()) >= 0
    assert int(ids.max()) < card


def test_sample_ids_follow_pmf() -> None:
    card, n = 40_000_000, 200_000
    ids = sample_ids(card, n, torch.Generator().manual_seed(1))
    # Head: empirical frequencies of the top ranks match the pmf.
    pmf = zipf_pmf(torch.arange(5), card)
    freq = torch.bincount(ids[ids < 5], minlength=5).double() / n
    assert torch.allclose(freq, pmf, rtol=0.05)
    # Tail: the share of draws beyond the exact head matches 1 - P(head).
    head_mass = float(zipf_pmf(torch.arange(1 << 16), card).sum())
    tail_share = float((ids >= 1 << 16).double().mean())
    assert tail_share == pytest.approx(1.0 - head_mass, abs=0.005)


@pytest.mark.parametrize("card", [3, 1_000, 200_000])
def test_zipf_pmf_normalised(card: int) -> None:
    assert float(zipf_pmf(torch.arange(card), card).sum()) == pytest.approx(1.0, abs=1e-6)


def test_value_model_trained_vs_rare_rows() -> None:
    card = 40_000_000
    # An untrained model is TorchRec's uniform init.
    init = embedding_rows(0, torch.arange(1000), 64, card, model=ValueModel(trained_samples=0))
    assert float(init.abs().max()) <= 1.0 / math.sqrt(card)
    assert float(init.abs().max()) > 0.9 / math.sqrt(card)
    # Frequent ids have drifted far from init; rare ids barely.
    model = ValueModel(trained_samples=4.584e7)
    frequent = embedding_rows(0, torch.arange(200), 64, card, model=model)
    rare = embedding_rows(0, torch.arange(card - 200, card), 64, card, model=model)
    assert float(frequent.norm(dim=1).median()) > 20 * float(rare.norm(dim=1).median())
    # Heavy tails: excess kurtosis of frequent rows well above a Gaussian's 0.
    z = (frequent - frequent.mean()) / frequent.std()
    assert float((z**4).mean()) - 3.0 > 1.0


def test_relative_to_absolute_bounds_exact() -> None:
    blocks = [
        torch.tensor([[0.0, 1.0], [2.0, -3.0]]),
        torch.tensor([[0.5, 0.25]]),
        torch.full((3, 2), 7.0),
    ]
    assert relative_to_absolute_bounds(blocks, 0.01) == [0.01 * 5.0, 0.01 * 0.25, 0.0]
    assert relative_to_absolute_bounds(blocks, [0.05, 0.5, 0.03]) == [0.05 * 5.0, 0.125, 0.0]
    with pytest.raises(ValueError, match="2 relative bounds for 3 blocks"):
        relative_to_absolute_bounds(blocks, [0.01, 0.02])


def test_paper_class_bounds() -> None:
    kaggle = paper_class_bounds("criteo_kaggle")
    assert len(kaggle) == 26
    assert (kaggle.count(0.01), kaggle.count(0.03), kaggle.count(0.05)) == (7, 8, 11)
    assert kaggle[2] == 0.01  # C3, 10.1M rows
    assert kaggle[0] == 0.03  # C1, 1,460 rows
    assert kaggle[8] == 0.05  # C9, 3 rows
    tb = paper_class_bounds("criteo_1tb", tight=0.02)
    assert (tb.count(0.02), tb.count(0.03), tb.count(0.05)) == (8, 9, 9)


def test_frequency_ranks() -> None:
    ids = torch.tensor([5, 3, 5, 7, 3, 5])
    assert frequency_ranks(ids).tolist() == [0, 1, 0, 2, 1, 0]
    assert frequency_ranks(torch.tensor([9, 2, 9, 2])).tolist() == [1, 0, 1, 0]


def test_criteo_reader_hashing(tmp_path: Path) -> None:
    cats = ["a"] * 26
    cats[0], cats[5], cats[25] = "ff", "", "0000000b"
    line = "\t".join(["1"] + [""] * 13 + cats)
    path = tmp_path / "rows.tsv"
    path.write_text(line + "\n" + line + "\n")
    ids = criteo_sample_ids(path, "criteo_kaggle")
    assert ids.shape == (2, 26)
    cards = CRITEO_KAGGLE_CARDINALITIES
    assert ids[0, 0] == 0xFF % cards[0]
    assert ids[0, 5] == 0  # missing
    assert ids[0, 25] == 11 % cards[25]
    assert ids[1, 1] == 10 % cards[1]
    assert ids[0, 8] == 10 % 3
    bad = tmp_path / "bad.tsv.gz"
    with gzip.open(bad, "wt") as fh:
        fh.write("1\t2\t3\n")
    with pytest.raises(ValueError, match=r"bad\.tsv\.gz:1: expected 40"):
        criteo_sample_ids(bad)
    with pytest.raises(FileNotFoundError, match="not found"):
        criteo_sample_ids(tmp_path / "missing.tsv.gz")


@needs_sample
def test_criteo_shared_sample() -> None:
    ids = criteo_sample_ids()
    assert ids.shape == (1000, 26)
    cards = torch.tensor(CRITEO_1TB_CARDINALITIES)
    assert bool((ids >= 0).all())
    assert bool((ids < cards).all())
    # Real small tables are skewed: C6 (3 rows) shows 2 values in 1,000 rows.
    assert ids[:, 5].unique().numel() == 2
    # C14 is missing in 461 of the 1,000 rows.
    assert int((ids[:, 13] == 0).sum()) >= 461


@needs_sample
def test_criteo_blocks() -> None:
    spec = TrafficSpec(preset="criteo_1tb", dim=64, batch_rows=250, source="criteo")
    blocks = make_blocks(spec)
    assert [tuple(b.shape) for b in blocks] == [(250, 64)] * 26
    whole = make_blocks(TrafficSpec(preset="criteo_1tb", dim=64, batch_rows=1000, source="criteo"))
    second = make_blocks(
        TrafficSpec(preset="criteo_1tb", dim=64, batch_rows=250, batch=1, source="criteo")
    )
    assert all(torch.equal(w[250:500], s) for w, s in zip(whole, second, strict=True))
    ids = criteo_sample_ids()
    assert [b.unique(dim=0).shape[0] for b in whole] == [
        ids[:, t].unique().numel() for t in range(26)
    ]
    with pytest.raises(ValueError, match="has 1000 rows"):
        make_blocks(TrafficSpec(preset="criteo_1tb", batch_rows=1024, source="criteo"))


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="source"):
        TrafficSpec(source="kaggle")
    with pytest.raises(ValueError, match="dim >= 1"):
        TrafficSpec(dim=0)
    with pytest.raises(ValueError, match="rank >= 1"):
        ValueModel(rank=0)
