"""Criteo data for the DLRM example: a synthetic stream with a planted signal and real-data readers.

Three sources yield TorchRec :class:`~torchrec.datasets.utils.Batch` objects for one rank:
:class:`SyntheticCriteo` (deterministic; labels from a hidden logistic model, :class:`HiddenModel`,
whose own AUC is the ceiling), :class:`RawCriteoReader` (Criteo Kaggle / 1TB TSV; malformed rows
counted, skipped, reported) and :class:`NpyCriteoReader` (TorchRec's ``*.npy``, memory-mapped).
All shard alike: global row ``i`` belongs to rank ``i % world_size``, and every
``holdout_every``-th row of a rank is held out. Details: ``docs/example.md``, "Data".
"""

from __future__ import annotations

import functools
import gzip
import io
import math
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lossy.cardinalities import NUM_SPARSE_FEATURES, PRESETS
from torchrec_lossy.traffic import sample_ids

__all__ = [
    "DEFAULT_MAX_ROWS",
    "FEATURE_NAMES",
    "NUM_DENSE_FEATURES",
    "TABLE_NAMES",
    "HiddenModel",
    "NpyCriteoReader",
    "ParseStats",
    "RawCriteoReader",
    "Split",
    "SyntheticCriteo",
    "dense_transform",
    "make_batch",
    "parse_line",
    "table_sizes",
]

NUM_DENSE_FEATURES = 13
# Feature and table names match the shipped planner configs (configs/criteo_*.yaml), so their
# per-table overrides apply to the example's model.
FEATURE_NAMES: tuple[str, ...] = tuple(f"cat_{i}" for i in range(NUM_SPARSE_FEATURES))
TABLE_NAMES: tuple[str, ...] = tuple(f"t_{f}" for f in FEATURE_NAMES)
# Rows of the largest tables: 26 tables x dim 16-128 fit a small machine at this cap.
DEFAULT_MAX_ROWS = 100_000
_NUM_FIELDS = 1 + NUM_DENSE_FEATURES + NUM_SPARSE_FEATURES

Split = Literal["train", "eval"]


def table_sizes(preset: str = "criteo_kaggle", max_rows: int = DEFAULT_MAX_ROWS) -> list[int]:
    """Rows per table: the published Criteo table sizes, capped at ``max_rows``.

    Small tables keep their real size (their skew and repetition are what the codec feeds on);
    large ones are capped so the model fits in memory.

    Args:
        preset: ``"criteo_kaggle"`` or ``"criteo_1tb"``.
        max_rows: Cap on any table's rows (>= 1).

    Returns:
        26 table sizes, C1..C26.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; use one of {sorted(PRESETS)}")
    if max_rows < 1:
        raise ValueError(f"max_rows={max_rows} is invalid: allowed an integer >= 1")
    return [min(c, max_rows) for c in PRESETS[preset]]


def dense_transform(raw: np.ndarray) -> np.ndarray:
    """DLRM's transform of the 13 count features: negatives clipped to 0, then ``log(x + 3)``.

    Args:
        raw: Integer counts, any shape (missing values already 0).

    Returns:
        float32 array of the same shape.
    """
    return np.log(np.maximum(raw.astype(np.float64), 0.0) + 3.0).astype(np.float32)


def make_batch(dense: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor) -> Batch:
    """A TorchRec ``Batch`` of single-hot samples.

    Args:
        dense: float32 ``[n, 13]`` transformed dense features.
        ids: int64 ``[n, 26]`` table ids (already reduced modulo the table sizes).
        labels: ``[n]`` labels in {0, 1}.

    Returns:
        The batch; its KJT has one id per sample and feature, keys :data:`FEATURE_NAMES`.
    """
    n = ids.shape[0]
    kjt = KeyedJaggedTensor(
        keys=list(FEATURE_NAMES),
        # Feature-major: all samples of cat_0, then all of cat_1, ...
        values=ids.t().contiguous().view(-1).to(torch.int64),
        lengths=torch.ones(NUM_SPARSE_FEATURES * n, dtype=torch.int32),
        stride=n,
    )
    return Batch(
        dense_features=dense.to(torch.float32).contiguous(),
        sparse_features=kjt,
        labels=labels.to(torch.float32).contiguous(),
    )


# ------------------------------------------------------------------------------------------------
# Synthetic data with a planted signal
# ------------------------------------------------------------------------------------------------

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_MIX1 = _U64(0xBF58476D1CE4E5B9)
_MIX2 = _U64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser (numpy uint64 arithmetic wraps, as intended)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> _U64(30))) * _MIX1
        z = (z ^ (z >> _U64(27))) * _MIX2
    return z ^ (z >> _U64(31))


def _hash_normal(keys: np.ndarray) -> np.ndarray:
    """One standard normal per uint64 key (counter-based: same key, same value)."""
    u = ((_splitmix64(keys) >> _U64(11)).astype(np.float64) + 0.5) * 2.0**-53
    return torch.special.ndtri(torch.from_numpy(u)).numpy()


def _seed_of(*parts: int) -> int:
    """A 63-bit generator seed from a tuple of small non-negative ints."""
    h = np.zeros(1, dtype=_U64)
    for p in parts:
        h = _splitmix64(h ^ np.array([p & 0xFFFFFFFFFFFFFFFF], dtype=_U64))
    return int(h[0] >> _U64(1))


@functools.lru_cache(maxsize=8)
def _table_keys(seed: int, n_tables: int) -> np.ndarray:
    """The hash key of each table's id effects (cached: every batch of a run uses the same)."""
    keys = np.array([_seed_of(seed, 2, t) for t in range(n_tables)], dtype=_U64)
    keys.flags.writeable = False
    return keys


@dataclass(frozen=True)
class HiddenModel:
    """The model the synthetic labels are drawn from: ``y ~ Bernoulli(sigmoid(logit))``.

    ``logit = bias + w . (dense - center) + sum_t s * z(seed, t, id_t)``, where ``z`` is a fixed
    standard normal per (table, id) from a counter-based hash: every id of every table has its
    own hidden effect, and the frequent ids (Zipf head) are the ones a model can learn.

    Attributes:
        seed: Seed of the hidden weights and id effects.
        id_effect_std: Standard deviation of the summed id effects (over all 26 tables).
        dense_effect_std: Standard deviation of the dense part, roughly.
        bias: Intercept; -1.2 gives a click rate near Criteo's ~25%.
    """

    seed: int = 0
    id_effect_std: float = 1.2
    dense_effect_std: float = 0.8
    bias: float = -1.2

    @property
    def dense_weights(self) -> np.ndarray:
        """The hidden linear weights of the 13 dense features (float64 ``[13]``)."""
        keys = _splitmix64(np.arange(NUM_DENSE_FEATURES, dtype=_U64) + _U64(_seed_of(self.seed, 1)))
        w = _hash_normal(keys)
        # Per-feature std of the transformed counts is about 1 (see _dense_raw): scale the sum.
        return w * (self.dense_effect_std / math.sqrt(float((w**2).sum())))

    def id_effects(self, ids: np.ndarray) -> np.ndarray:
        """Summed hidden effects of the ids of each sample.

        Args:
            ids: int64 ``[n, 26]``.

        Returns:
            float64 ``[n]``.
        """
        table_keys = _table_keys(self.seed, ids.shape[1])
        z = _hash_normal(_splitmix64(ids.astype(_U64) ^ table_keys[None, :]))
        return z.sum(axis=1) * (self.id_effect_std / math.sqrt(ids.shape[1]))

    def logits(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The hidden logits.

        Args:
            dense: float32 ``[n, 13]`` transformed dense features.
            ids: int64 ``[n, 26]``.

        Returns:
            float64 ``[n]``.
        """
        centered = dense.astype(np.float64) - _DENSE_CENTER
        return self.bias + centered @ self.dense_weights + self.id_effects(ids)


# Transformed counts: raw = floor(exp(mu + sigma * z)) - 1, so log(raw + 3) is centred near mu.
_DENSE_MU = np.linspace(0.5, 4.0, NUM_DENSE_FEATURES)
_DENSE_SIGMA = np.full(NUM_DENSE_FEATURES, 1.0)
_DENSE_CENTER = np.log(np.exp(_DENSE_MU) + 2.0)


class SyntheticCriteo:
    """An endless Criteo-like stream for one rank, with labels from a :class:`HiddenModel`.

    At step ``s`` each rank draws its ``batch_size`` rows from ``(seed, split, s, rank)`` alone
    (global row ``j`` of the step belongs to rank ``j % world_size``), so the stream is
    deterministic for a given world size and resumes exactly from a step number.

    Args:
        sizes: Rows per table (26).
        batch_size: Rows per rank and step.
        rank: This rank.
        world_size: Number of ranks.
        seed: Data seed (ids, dense features, labels and the hidden model).
        split: ``"train"`` or ``"eval"`` (independent streams).
        hidden: The hidden model; default ``HiddenModel(seed)``.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        split: Split = "train",
        hidden: HiddenModel | None = None,
    ) -> None:
        if len(sizes) != NUM_SPARSE_FEATURES:
            raise ValueError(f"expected {NUM_SPARSE_FEATURES} table sizes, got {len(sizes)}")
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need batch_size >= 1 and 0 <= rank < world_size; got batch_size={batch_size}, "
                f"rank={rank}, world_size={world_size}"
            )
        self.sizes = list(sizes)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.split = split
        self.hidden = hidden if hidden is not None else HiddenModel(seed)
        self._split_id = 0 if split == "train" else 1

    def block(self, step: int, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The rows of one rank at one step, drawn from ``(seed, split, step, rank)`` alone.

        Args:
            step: Step number (>= 0).
            rank: The rank whose rows to draw.

        Returns:
            ``(dense float32 [B, 13], ids int64 [B, 26], labels float32 [B], logits float64
            [B])`` with ``B = batch_size``.
        """
        n = self.batch_size
        gen = torch.Generator().manual_seed(_seed_of(self.seed, 10 + self._split_id, step, rank))
        ids = torch.stack([sample_ids(c, n, gen) for c in self.sizes], dim=1).numpy()
        z = torch.randn(n, NUM_DENSE_FEATURES, generator=gen, dtype=torch.float64).numpy()
        raw = np.floor(np.exp(_DENSE_MU + _DENSE_SIGMA * z)) - 1.0
        # Like the real data, some counts are missing (read as 0).
        missing = torch.rand(n, NUM_DENSE_FEATURES, generator=gen).numpy() < 0.1
        raw[missing] = 0.0
        dense = dense_transform(raw)
        logits = self.hidden.logits(dense, ids)
        u = torch.rand(n, generator=gen, dtype=torch.float64).numpy()
        labels = (u < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        return dense, ids, labels, logits

    def rows(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """This rank's rows of one step (each rank draws only its own).

        Args:
            step: Step number.

        Returns:
            As :meth:`block`.
        """
        return self.block(step, self.rank)

    def global_rows(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """All ranks' rows of one step, interleaved: global row ``j`` is rank ``j % world_size``'s.

        Args:
            step: Step number.

        Returns:
            As :meth:`block`, ``batch_size * world_size`` rows.
        """
        blocks = [self.block(step, r) for r in range(self.world_size)]

        def interleave(k: int) -> np.ndarray:
            parts = [b[k] for b in blocks]
            return np.stack(parts, axis=1).reshape(-1, *parts[0].shape[1:])

        return interleave(0), interleave(1), interleave(2), interleave(3)

    def batch(self, step: int) -> Batch:
        """This rank's batch of one step.

        Args:
            step: Step number.

        Returns:
            The batch.
        """
        dense, ids, labels, _ = self.rows(step)
        return make_batch(torch.from_numpy(dense), torch.from_numpy(ids), torch.from_numpy(labels))

    def batches(self, start: int = 0, stop: int | None = None) -> Iterator[Batch]:
        """Batches of steps ``start, start + 1, ...`` (endless when ``stop`` is None).

        Args:
            start: First step.
            stop: Step to stop before; None: never stop.

        Yields:
            Batches.
        """
        step = start
        while stop is None or step < stop:
            yield self.batch(step)
            step += 1


# ------------------------------------------------------------------------------------------------
# Raw Criteo TSV files
# ------------------------------------------------------------------------------------------------


@dataclass
class ParseStats:
    """What a reader saw on this rank.

    Attributes:
        rows: Rows of this rank read (kept + malformed).
        kept: Rows parsed into samples.
        malformed: Skipped rows by reason.
        examples: Up to 5 ``"line N: reason"`` strings, for the report.
    """

    rows: int = 0
    kept: int = 0
    malformed: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    @property
    def skipped(self) -> int:
        """Total malformed rows."""
        return sum(self.malformed.values())

    def add_malformed(self, lineno: int, reason: str) -> None:
        """Counts one malformed row.

        Args:
            lineno: 1-based line number in its file.
            reason: Why it was rejected.
        """
        self.malformed[reason] += 1
        if len(self.examples) < 5:
            self.examples.append(f"line {lineno}: {reason}")


def parse_line(line: str, sizes: Sequence[int]) -> tuple[int, list[int], list[int]] | str:
    """Parses one raw Criteo line: label, 13 integer and 26 hex categorical fields, tab-separated.

    Empty fields are missing values (0 for counts, id 0 for categoricals); categoricals are
    hashed as ``int(value, 16) % size``.

    Args:
        line: The line (trailing newline allowed).
        sizes: Table sizes to hash into (26).

    Returns:
        ``(label, counts, ids)``, or a string saying why the row is malformed.
    """
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != _NUM_FIELDS:
        return f"expected {_NUM_FIELDS} tab-separated fields, got {len(fields)}"
    label = fields[0]
    if label not in ("0", "1"):
        return f"label {label[:16]!r} is not 0 or 1"
    try:
        counts = [int(v) if v else 0 for v in fields[1 : 1 + NUM_DENSE_FEATURES]]
    except ValueError:
        return "a count field is not an integer"
    try:
        ids = [
            int(v, 16) % s if v else 0
            for v, s in zip(fields[1 + NUM_DENSE_FEATURES :], sizes, strict=True)
        ]
    except ValueError:
        return "a categorical field is not hexadecimal"
    return int(label), counts, ids


def _open_text(path: Path) -> IO[str]:
    """Opens a file for reading as text, gunzipping it when it starts with the gzip magic."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _is_eval_row(local_index: int, holdout_every: int) -> bool:
    return holdout_every > 0 and local_index % holdout_every == holdout_every - 1


class RawCriteoReader:
    """Streams one rank's rows of raw Criteo TSV files (plain or gzipped), never all in memory.

    Args:
        paths: The files, read in order as one stream (global row numbers run across them).
        sizes: Table sizes to hash categoricals into (26).
        rank: This rank.
        world_size: Number of ranks.
        holdout_every: Every this-many-th row of this rank is held out for evaluation; 0: none.

    Attributes:
        stats: Counts of the rows read by the last pass of :meth:`rows` per split.
    """

    def __init__(
        self,
        paths: Sequence[str | Path],
        sizes: Sequence[int],
        rank: int = 0,
        world_size: int = 1,
        holdout_every: int = 16,
    ) -> None:
        self.paths = [Path(p) for p in paths]
        for p in self.paths:
            if not p.is_file():
                raise FileNotFoundError(
                    f"Criteo file {p} not found: pass --data-path with a raw Criteo TSV file "
                    "(Kaggle train.txt or 1TB day_N[.gz])"
                )
        if len(sizes) != NUM_SPARSE_FEATURES:
            raise ValueError(f"expected {NUM_SPARSE_FEATURES} table sizes, got {len(sizes)}")
        self.sizes = list(sizes)
        self.rank = rank
        self.world_size = world_size
        self.holdout_every = holdout_every
        self.stats: dict[str, ParseStats] = {"train": ParseStats(), "eval": ParseStats()}

    def rows(self, split: Split) -> Iterator[tuple[int, list[int], list[int]]]:
        """This rank's well-formed rows of one split, in file order.

        Malformed rows are counted in ``stats[split]`` and skipped; they still count as rows
        for sharding and holdout, so the split of a file never depends on its errors.

        Args:
            split: ``"train"`` or ``"eval"``.

        Yields:
            ``(label, counts, ids)`` per row.
        """
        stats = self.stats[split] = ParseStats()
        want_eval = split == "eval"
        global_row = 0
        local = 0
        for path in self.paths:
            with _open_text(path) as fh:
                for lineno, line in enumerate(fh, 1):
                    mine = global_row % self.world_size == self.rank
                    global_row += 1
                    if not mine:
                        continue
                    is_eval = _is_eval_row(local, self.holdout_every)
                    local += 1
                    if is_eval != want_eval:
                        continue
                    stats.rows += 1
                    parsed = parse_line(line, self.sizes)
                    if isinstance(parsed, str):
                        stats.add_malformed(lineno, f"{path.name}: {parsed}")
                        continue
                    stats.kept += 1
                    yield parsed

    def batches(self, split: Split, batch_size: int, skip: int = 0) -> Iterator[Batch]:
        """Full batches of one split, in file order (a last partial batch is dropped).

        Args:
            split: ``"train"`` or ``"eval"``.
            batch_size: Rows per batch.
            skip: Batches to skip first (resuming mid-epoch).

        Yields:
            Batches.
        """
        labels: list[int] = []
        counts: list[list[int]] = []
        ids: list[list[int]] = []
        done = 0
        for label, c, i in self.rows(split):
            labels.append(label)
            counts.append(c)
            ids.append(i)
            if len(labels) == batch_size:
                if done >= skip:
                    yield _to_batch(labels, counts, ids)
                done += 1
                labels, counts, ids = [], [], []

    def arrays(self, split: Split, max_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Up to ``max_rows`` well-formed rows of one split as arrays (for the held-out set).

        Args:
            split: ``"train"`` or ``"eval"``.
            max_rows: Most rows to read.

        Returns:
            ``(dense float32 [n, 13], ids int64 [n, 26], labels float32 [n])``.
        """
        labels: list[int] = []
        counts: list[list[int]] = []
        ids: list[list[int]] = []
        if max_rows > 0:
            for label, c, i in self.rows(split):
                labels.append(label)
                counts.append(c)
                ids.append(i)
                if len(labels) >= max_rows:
                    break
        return (
            dense_transform(np.asarray(counts, dtype=np.int64).reshape(-1, NUM_DENSE_FEATURES)),
            np.asarray(ids, dtype=np.int64).reshape(-1, NUM_SPARSE_FEATURES),
            np.asarray(labels, dtype=np.float32),
        )


def _to_batch(labels: list[int], counts: list[list[int]], ids: list[list[int]]) -> Batch:
    dense = dense_transform(np.asarray(counts, dtype=np.int64))
    return make_batch(
        torch.from_numpy(dense),
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor(labels, dtype=torch.float32),
    )


# ------------------------------------------------------------------------------------------------
# TorchRec's preprocessed npy files
# ------------------------------------------------------------------------------------------------


class NpyCriteoReader:
    """One rank's rows of TorchRec's preprocessed Criteo npy files, memory-mapped.

    The files are those ``BinaryCriteoUtils.tsv_to_npys`` (and TorchRec's
    ``npy_preproc_criteo.py``) write: ``<stem>_dense.npy`` (float32, already log-transformed),
    ``<stem>_sparse.npy`` (raw integer ids) and ``<stem>_labels.npy``. Sparse ids are reduced
    modulo the table sizes here, as ``InMemoryBinaryCriteoIterDataPipe(hashes=...)`` does.

    Args:
        directory: Folder with the npy triples (all ``*_dense.npy`` in it, sorted by name).
        sizes: Table sizes (26).
        rank: This rank.
        world_size: Number of ranks.
        holdout_every: As :class:`RawCriteoReader`.
    """

    def __init__(
        self,
        directory: str | Path,
        sizes: Sequence[int],
        rank: int = 0,
        world_size: int = 1,
        holdout_every: int = 16,
    ) -> None:
        d = Path(directory)
        dense_files = sorted(d.glob("*_dense.npy"), key=_natural_key)
        if not dense_files:
            raise FileNotFoundError(
                f"no *_dense.npy files in {d}: pass --data-path with a folder of TorchRec's "
                "preprocessed Criteo files (day_N_dense.npy, day_N_sparse.npy, day_N_labels.npy)"
            )
        self.files: list[tuple[Path, Path, Path]] = []
        for f in dense_files:
            stem = f.name[: -len("_dense.npy")]
            sparse, labels = d / f"{stem}_sparse.npy", d / f"{stem}_labels.npy"
            for p in (sparse, labels):
                if not p.is_file():
                    raise FileNotFoundError(f"{f} has no matching {p.name} in {d}")
            self.files.append((f, sparse, labels))
        self.sizes = np.asarray(sizes, dtype=np.int64).reshape(1, -1)
        self.rank = rank
        self.world_size = world_size
        self.holdout_every = holdout_every

    def _rank_rows(
        self, split: Split
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Per file: its memory-mapped (dense, sparse, labels) and this rank's row indices."""
        offset = 0  # global row number of the file's first row
        local0 = 0  # this rank's rows in earlier files
        for dense_f, sparse_f, labels_f in self.files:
            dense = np.load(dense_f, mmap_mode="r")
            sparse = np.load(sparse_f, mmap_mode="r")
            labels = np.load(labels_f, mmap_mode="r").reshape(-1)
            n = dense.shape[0]
            if sparse.shape[0] != n or labels.shape[0] != n:
                raise ValueError(
                    f"{dense_f.name}, {sparse_f.name}, {labels_f.name} have {n}, "
                    f"{sparse.shape[0]}, {labels.shape[0]} rows: they must match"
                )
            mine = np.arange((self.rank - offset) % self.world_size, n, self.world_size)
            local = local0 + np.arange(mine.shape[0])
            h = self.holdout_every
            is_eval = local % h == h - 1 if h > 0 else np.zeros(mine.shape[0], dtype=bool)
            local0 += mine.shape[0]
            offset += n
            yield dense, sparse, labels, mine[is_eval] if split == "eval" else mine[~is_eval]

    def batches(self, split: Split, batch_size: int, skip: int = 0) -> Iterator[Batch]:
        """Full batches of one split in file order (a partial batch at a file's end is dropped).

        Args:
            split: ``"train"`` or ``"eval"``.
            batch_size: Rows per batch.
            skip: Batches to skip first (resuming mid-epoch).

        Yields:
            Batches.
        """
        done = 0
        for dense, sparse, labels, mine in self._rank_rows(split):
            for b in range(mine.shape[0] // batch_size):
                if done >= skip:
                    idx = mine[b * batch_size : (b + 1) * batch_size]
                    ids = np.asarray(sparse[idx], dtype=np.int64) % self.sizes
                    yield make_batch(
                        torch.from_numpy(np.asarray(dense[idx], dtype=np.float32)),
                        torch.from_numpy(ids),
                        torch.from_numpy(np.asarray(labels[idx], dtype=np.float32)),
                    )
                done += 1

    def arrays(self, split: Split, max_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Up to ``max_rows`` rows of one split as arrays (for the held-out set).

        Args:
            split: ``"train"`` or ``"eval"``.
            max_rows: Most rows to read.

        Returns:
            ``(dense float32 [n, 13], ids int64 [n, 26], labels float32 [n])``.
        """
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        left = max_rows
        for dense, sparse, labels, mine in self._rank_rows(split):
            if left <= 0:
                break
            idx = mine[:left]
            left -= idx.shape[0]
            parts.append(
                (
                    np.asarray(dense[idx], dtype=np.float32),
                    np.asarray(sparse[idx], dtype=np.int64) % self.sizes,
                    np.asarray(labels[idx], dtype=np.float32),
                )
            )
        if not parts:
            return (
                np.zeros((0, NUM_DENSE_FEATURES), np.float32),
                np.zeros((0, NUM_SPARSE_FEATURES), np.int64),
                np.zeros(0, np.float32),
            )
        return (
            np.concatenate([p[0] for p in parts]),
            np.concatenate([p[1] for p in parts]),
            np.concatenate([p[2] for p in parts]),
        )


def _natural_key(p: Path) -> list[object]:
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", p.name)]
