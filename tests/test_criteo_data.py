"""The example's data readers: synthetic stream (determinism, planted signal), raw TSV, npy."""

from __future__ import annotations

import gzip
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import criteo_data as cd  # noqa: E402

from torchrec_lossy.traffic import DEFAULT_CRITEO_SAMPLE  # noqa: E402

needs_sample = pytest.mark.skipif(
    not DEFAULT_CRITEO_SAMPLE.is_file(), reason=f"Criteo sample {DEFAULT_CRITEO_SAMPLE} missing"
)
SAMPLE_ROWS = 1000


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    from torchmetrics.functional.classification import binary_auroc

    return float(binary_auroc(torch.from_numpy(scores).float(), torch.from_numpy(labels).long()))


# ------------------------------------------------------------------------------------------------
# Synthetic


def test_table_sizes_capped_and_real() -> None:
    sizes = cd.table_sizes("criteo_kaggle", 100_000)
    assert len(sizes) == 26
    assert max(sizes) == 100_000
    assert sizes[8] == 3  # C9 of Kaggle has 3 values: small tables keep their real size
    assert cd.table_sizes("criteo_1tb", 50)[0] == 50
    with pytest.raises(ValueError, match="unknown preset"):
        cd.table_sizes("criteo_2tb")


def test_synthetic_is_deterministic_and_sharded() -> None:
    sizes = cd.table_sizes(max_rows=5000)
    a = cd.SyntheticCriteo(sizes, 64, rank=1, world_size=2, seed=7)
    b = cd.SyntheticCriteo(sizes, 64, rank=1, world_size=2, seed=7)
    for x, y in zip(a.rows(3), b.rows(3), strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.rows(3)[1], a.rows(4)[1])  # steps differ
    other_seed = cd.SyntheticCriteo(sizes, 64, rank=1, world_size=2, seed=8)
    assert not np.array_equal(a.rows(3)[1], other_seed.rows(3)[1])
    # Global row j of a step belongs to rank j % world_size.
    dense, ids, labels, _ = a.global_rows(3)
    assert ids.shape == (128, 26) and dense.shape == (128, 13)
    np.testing.assert_array_equal(ids[1::2], a.rows(3)[1])
    np.testing.assert_array_equal(labels[1::2], a.rows(3)[2])
    r0 = cd.SyntheticCriteo(sizes, 64, rank=0, world_size=2, seed=7)
    np.testing.assert_array_equal(ids[0::2], r0.rows(3)[1])
    # Held-out and training streams are independent.
    held = cd.SyntheticCriteo(sizes, 64, rank=1, world_size=2, seed=7, split="eval")
    assert not np.array_equal(held.rows(3)[1], a.rows(3)[1])
    assert (ids >= 0).all() and (ids < np.asarray(sizes)).all()
    assert set(np.unique(labels)) <= {0.0, 1.0}


def test_synthetic_batch_is_a_torchrec_batch() -> None:
    sizes = cd.table_sizes(max_rows=1000)
    batch = cd.SyntheticCriteo(sizes, 16, seed=1).batch(0)
    kjt = batch.sparse_features
    assert kjt.keys() == list(cd.FEATURE_NAMES)
    assert kjt.stride() == 16
    assert torch.equal(kjt.lengths(), torch.ones(26 * 16, dtype=torch.int32))
    assert batch.dense_features.shape == (16, 13) and batch.dense_features.dtype == torch.float32
    assert batch.labels.shape == (16,)
    ids = cd.SyntheticCriteo(sizes, 16, seed=1).rows(0)[1]
    assert torch.equal(kjt["cat_4"].values(), torch.from_numpy(ids[:, 4]))


def test_planted_signal_present() -> None:
    """Labels follow the hidden model: its AUC is high, and both parts of it carry signal."""
    sizes = cd.table_sizes()
    data = cd.SyntheticCriteo(sizes, 4096, seed=0)
    rows = [data.rows(k) for k in range(5)]
    dense = np.concatenate([r[0] for r in rows])
    ids = np.concatenate([r[1] for r in rows])
    labels = np.concatenate([r[2] for r in rows])
    logits = np.concatenate([r[3] for r in rows])
    assert 0.15 < labels.mean() < 0.45  # a Criteo-like click rate
    assert _auc(logits, labels) > 0.74
    hidden = data.hidden
    dense_part = (dense.astype(np.float64) - cd._DENSE_CENTER) @ hidden.dense_weights
    assert _auc(dense_part, labels) > 0.58
    assert _auc(hidden.id_effects(ids), labels) > 0.66
    # The id effects are learnable from data: the frequent ids of a small table show their
    # effect in the empirical click rate.
    t = 5  # 24 rows, very skewed
    probe = np.zeros((sizes[t], 26), dtype=np.int64)
    probe[:, t] = np.arange(sizes[t])
    effect = hidden.id_effects(probe)  # the other tables' ids are fixed: only table t varies
    counts = np.bincount(ids[:, t], minlength=sizes[t])
    clicks = np.bincount(ids[:, t], weights=labels, minlength=sizes[t])
    frequent = counts >= 200
    assert frequent.sum() >= 3
    ctr = clicks[frequent] / counts[frequent]
    assert np.corrcoef(ctr, effect[frequent])[0, 1] > 0.5


def test_dense_transform() -> None:
    out = cd.dense_transform(np.array([-5, 0, 1, 100]))
    np.testing.assert_allclose(out, np.log([3.0, 3.0, 4.0, 103.0]), rtol=1e-6)
    assert out.dtype == np.float32


# ------------------------------------------------------------------------------------------------
# Raw TSV


def test_parse_line() -> None:
    sizes = [10] * 26
    line = "1\t" + "\t".join(["5", "", "-1"] + ["0"] * 10) + "\t" + "\t".join(["ff", ""] * 13)
    label, counts, ids = cd.parse_line(line + "\n", sizes)
    assert label == 1
    assert counts[:3] == [5, 0, -1]
    assert ids[:2] == [255 % 10, 0]
    assert "fields" in cd.parse_line("1\t2\t3", sizes)
    assert "label" in cd.parse_line("x" + line[1:], sizes)
    assert "integer" in cd.parse_line(line.replace("\t5\t", "\t5.5\t", 1), sizes)
    assert "hexadecimal" in cd.parse_line(line.replace("\tff\t", "\tzz\t", 1), sizes)


@needs_sample
def test_raw_reader_parses_the_shared_sample() -> None:
    sizes = cd.table_sizes("criteo_1tb")
    reader = cd.RawCriteoReader([DEFAULT_CRITEO_SAMPLE], sizes, holdout_every=16)
    train = list(reader.rows("train"))
    held = list(reader.rows("eval"))
    assert len(train) + len(held) == SAMPLE_ROWS
    assert len(held) == SAMPLE_ROWS // 16
    assert reader.stats["train"].skipped == 0 and reader.stats["eval"].skipped == 0
    labels = np.array([r[0] for r in train + held])
    assert set(np.unique(labels)) <= {0, 1} and labels.sum() > 0
    ids = np.array([r[2] for r in train])
    assert (ids >= 0).all() and (ids < np.asarray(sizes)).all()
    # Each rank reads its own rows (row i -> rank i % world_size): together they cover the file.
    per_rank = [
        cd.RawCriteoReader([DEFAULT_CRITEO_SAMPLE], sizes, r, 2, holdout_every=0) for r in range(2)
    ]
    counts = [sum(1 for _ in rd.rows("train")) for rd in per_rank]
    assert counts == [SAMPLE_ROWS // 2, SAMPLE_ROWS // 2]
    first = next(per_rank[1].rows("train"))
    with gzip.open(DEFAULT_CRITEO_SAMPLE, "rt") as f:
        f.readline()
        second_line = f.readline()
    assert first == cd.parse_line(second_line, sizes)
    # Batches: full ones only, skip for resuming.
    batches = list(reader.batches("train", 100))
    assert len(batches) == len(train) // 100
    resumed = list(reader.batches("train", 100, skip=2))
    assert torch.equal(resumed[0].labels, batches[2].labels)
    dense, ids_arr, labels_arr = reader.arrays("eval", 10)
    assert dense.shape == (10, 13) and ids_arr.shape == (10, 26) and labels_arr.shape == (10,)


@needs_sample
def test_raw_reader_counts_and_skips_malformed_rows(tmp_path: Path) -> None:
    with gzip.open(DEFAULT_CRITEO_SAMPLE, "rt") as f:
        lines = f.readlines()
    good = lines[0].rstrip("\n").split("\t")
    bad = {
        "fields": "\t".join(good[:20]),
        "label": "\t".join(["2", *good[1:]]),
        "integer": "\t".join([*good[:3], "abc", *good[4:]]),
        "hexadecimal": "\t".join([*good[:20], "xyz!", *good[21:]]),
        "empty": "",
    }
    out = []
    for i, line in enumerate(lines):
        out.append(line)
        if i % 200 == 0:  # 5 insertion points x 5 kinds = 25 bad rows
            out.extend(b + "\n" for b in bad.values())
    path = tmp_path / "day_0_corrupt.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(out)
    sizes = cd.table_sizes("criteo_1tb")
    reader = cd.RawCriteoReader([path], sizes, holdout_every=0)
    kept = sum(1 for _ in reader.rows("train"))
    stats = reader.stats["train"]
    assert kept == SAMPLE_ROWS
    assert stats.skipped == 25
    assert stats.rows == SAMPLE_ROWS + 25
    reasons = " ".join(stats.malformed)
    for word in ("fields", "label", "integer", "hexadecimal"):
        assert word in reasons
    assert len(stats.examples) == 5 and stats.examples[0].startswith("line ")
    # Plain (not gzipped) files are read too.
    plain = tmp_path / "train.txt"
    plain.write_text("".join(out))
    reader = cd.RawCriteoReader([plain], sizes, holdout_every=0)
    assert sum(1 for _ in reader.rows("train")) == SAMPLE_ROWS


def test_raw_reader_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--data-path"):
        cd.RawCriteoReader([tmp_path / "nope.tsv"], cd.table_sizes())


# ------------------------------------------------------------------------------------------------
# TorchRec npy


@needs_sample
def test_npy_reader_matches_torchrec_preprocessing(tmp_path: Path) -> None:
    from torchrec.datasets.criteo import BinaryCriteoUtils

    tsv = tmp_path / "day_0"
    with gzip.open(DEFAULT_CRITEO_SAMPLE, "rb") as src, open(tsv, "wb") as dst:
        shutil.copyfileobj(src, dst)
    BinaryCriteoUtils.tsv_to_npys(
        str(tsv),
        str(tmp_path / "day_0_dense.npy"),
        str(tmp_path / "day_0_sparse.npy"),
        str(tmp_path / "day_0_labels.npy"),
    )
    tsv.unlink()
    sizes = cd.table_sizes("criteo_1tb", 1000)
    reader = cd.NpyCriteoReader(tmp_path, sizes, rank=0, world_size=1, holdout_every=16)
    batches = list(reader.batches("train", 50))
    n_train = SAMPLE_ROWS - SAMPLE_ROWS // 16
    assert len(batches) == n_train // 50
    raw = cd.RawCriteoReader([DEFAULT_CRITEO_SAMPLE], sizes, holdout_every=16)
    raw_first = next(iter(raw.batches("train", 50)))
    # Same rows, same hashed ids and labels as the raw reader.
    assert torch.equal(batches[0].sparse_features.values(), raw_first.sparse_features.values())
    assert torch.equal(batches[0].labels, raw_first.labels)
    dense = batches[0].dense_features
    assert torch.isfinite(dense).all() and dense.min() >= 0
    held = reader.arrays("eval", 1000)
    assert held[0].shape[0] == SAMPLE_ROWS // 16
    # Two ranks split the rows.
    per_rank = [
        sum(
            b.labels.numel()
            for b in cd.NpyCriteoReader(tmp_path, sizes, r, 2, 0).batches("train", 1)
        )
        for r in range(2)
    ]
    assert per_rank == [SAMPLE_ROWS // 2, SAMPLE_ROWS // 2]
    assert math.isclose(sum(per_rank), SAMPLE_ROWS)


def test_npy_reader_needs_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"dense\.npy"):
        cd.NpyCriteoReader(tmp_path, cd.table_sizes())
