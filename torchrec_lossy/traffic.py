"""Realistic forward all-to-all traffic of a table-wise sharded DLRM, for codec tests and benches.

Per table, one batch's block is ``[batch_rows, dim]`` float32 (Criteo features are single-hot):
published table sizes, Zipf-skewed ids (:func:`zipf_alpha`) or real Criteo ids
(:func:`criteo_sample_ids`), and rows of a model that has trained a while (:class:`ValueModel`).
A row is a hash of ``(seed, table, id)``, so no table is materialised and an id always gets the
same row. Imports only torch and numpy (runs without torchrec). Details: ``docs/traffic.md``.
"""

from __future__ import annotations

import functools
import gzip
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from torchrec_lossy.cardinalities import NUM_SPARSE_FEATURES, PRESETS

__all__ = [
    "DEFAULT_CRITEO_SAMPLE",
    "LOOSE_MAX_ROWS",
    "TIGHT_MIN_ROWS",
    "TrafficSpec",
    "ValueModel",
    "criteo_sample_ids",
    "default_value_model",
    "embedding_rows",
    "frequency_ranks",
    "make_blocks",
    "paper_class_bounds",
    "relative_to_absolute_bounds",
    "sample_ids",
    "table_cardinalities",
    "zipf_alpha",
    "zipf_pmf",
]

# The shared Criteo sample lives beside the checkout (<repo>/../shared/data), never inside it.
DEFAULT_CRITEO_SAMPLE: Path = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "criteo_1tb_day0_head1000.tsv.gz"
)

# Skew model alpha(N) = 1 + _ALPHA_B / ln(N) ** _ALPHA_K, solved from two published batch facts
# (DESIGN §1): a 3-row table shows 2 distinct ids in a 2,048-row batch (alpha(3) = 9 gives 2.08
# expected) and a 36K-row table about 945 (alpha(36,000) = 1.042). Large tables tend to alpha = 1.
_ALPHA_B = 9.957
_ALPHA_K = 2.327
_ALPHA_MAX = 30.0  # beyond this the pmf of rank 2 underflows; tiny tables are one-hot anyway
# Ranks up to this count have an exact discrete CDF; the rest of the tail is a continuous
# power law (midpoint rule), which is accurate to ~1e-9 relative at this head size.
_HEAD_RANKS = 1 << 16

# Paper classes by cardinality (benchmark only; adaptive.py computes classes from the traffic).
TIGHT_MIN_ROWS = 100_000
LOOSE_MAX_ROWS = 1_000

# Training samples the modelled DLRM has seen: one epoch of each data set
# (Kaggle: 45,840,617 rows; 1TB: 24 days, about 4.37e9 rows).
_TRAINED_SAMPLES = {"criteo_kaggle": 4.584e7, "criteo_1tb": 4.37e9}

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_MIX1 = _U64(0xBF58476D1CE4E5B9)
_MIX2 = _U64(0x94D049BB133111EB)
# Hash streams, so that each random quantity of a row draws from its own counter space.
_STREAM_INIT, _STREAM_NOISE, _STREAM_COEF, _STREAM_SCALE, _STREAM_BASIS, _STREAM_MEAN = range(6)


@dataclass(frozen=True)
class ValueModel:
    """Embedding values of a DLRM that has trained a while (see ``docs/traffic.md``).

    Row ``x`` of id ``i`` in a table of ``N`` rows::

        x = init + w * g * (sqrt(f) * (a @ U) / sqrt(r) + sqrt(1 - f) * e + m * mu)
        init ~ U(-1/sqrt(N), 1/sqrt(N))         TorchRec's default init, per element
        w = c / (c + half_drift_count)           how far the row has drifted from init
        c = trained_samples * p(i)               expected training updates of the row
        g = drift_scale * exp(s z - s^2 / 2)     per-row gain, z ~ N(0, 1), s = row_scale_sigma
        a ~ N(0, 1)^r, U ~ N(0, 1)^(r x dim)     shared low-rank structure (U per table)
        e ~ Laplace, unit variance, per element  heavier-than-Gaussian tails
        mu ~ N(0, 1)^dim per table               a common offset of trained rows

    ``p(i)`` is the Zipf probability of id ``i`` (ids are popularity ranks, 0 = most popular).

    Attributes:
        trained_samples: Training samples seen by the model.
        half_drift_count: Expected updates after which a row is half-way drifted from init.
        drift_scale: RMS per element of a fully drifted row's drift.
        row_scale_sigma: Log-normal sigma of the per-row gain (heavy tails across rows).
        rank: Rank ``r`` of the shared structure.
        low_rank_fraction: Fraction ``f`` of the drift variance in the shared low-rank part.
        mean_shift: Weight ``m`` of the per-table common offset.
    """

    trained_samples: float = _TRAINED_SAMPLES["criteo_kaggle"]
    half_drift_count: float = 20.0
    drift_scale: float = 0.1
    row_scale_sigma: float = 0.5
    rank: int = 4
    low_rank_fraction: float = 0.5
    mean_shift: float = 0.5

    def __post_init__(self) -> None:
        if self.trained_samples < 0 or self.half_drift_count <= 0 or self.drift_scale < 0:
            raise ValueError(
                f"ValueModel needs trained_samples >= 0, half_drift_count > 0 and "
                f"drift_scale >= 0; got {self.trained_samples}, {self.half_drift_count}, "
                f"{self.drift_scale}"
            )
        if self.rank < 1 or not 0.0 <= self.low_rank_fraction <= 1.0:
            raise ValueError(
                f"ValueModel needs rank >= 1 and 0 <= low_rank_fraction <= 1; got rank="
                f"{self.rank}, low_rank_fraction={self.low_rank_fraction}"
            )


def default_value_model(preset: str) -> ValueModel:
    """The value model of a preset: a model trained for one epoch of that data set.

    Args:
        preset: ``"criteo_kaggle"`` or ``"criteo_1tb"``.

    Returns:
        The preset's :class:`ValueModel`.
    """
    _check_preset(preset)
    return ValueModel(trained_samples=_TRAINED_SAMPLES[preset])


@dataclass(frozen=True)
class TrafficSpec:
    """What traffic :func:`make_blocks` generates.

    Attributes:
        preset: Table sizes, ``"criteo_kaggle"`` or ``"criteo_1tb"``.
        dim: Embedding dimension (32 for Kaggle-like traffic; 64 or 128 for 1TB-like).
        batch_rows: Rows per block (samples a rank sends to one destination).
        seed: Seed of the ids and of the embedding values.
        batch: Index of the batch in the stream; batches differ in ids, not in the rows of an id.
        source: ``"zipf"`` for synthetic ids, ``"criteo"`` for ids from real Criteo rows.
        criteo_path: The Criteo TSV(.gz) file for ``source="criteo"`` (default: the shared
            sample, :data:`DEFAULT_CRITEO_SAMPLE`).
        value_model: Embedding value model; ``None`` takes :func:`default_value_model`.
    """

    preset: str = "criteo_kaggle"
    dim: int = 32
    batch_rows: int = 2048
    seed: int = 0
    batch: int = 0
    source: str = "zipf"
    criteo_path: str | Path | None = None
    value_model: ValueModel | None = None

    def __post_init__(self) -> None:
        _check_preset(self.preset)
        if self.dim < 1 or self.batch_rows < 1 or self.batch < 0:
            raise ValueError(
                f"TrafficSpec needs dim >= 1, batch_rows >= 1 and batch >= 0; got dim={self.dim}"
                f", batch_rows={self.batch_rows}, batch={self.batch}"
            )
        if self.source not in ("zipf", "criteo"):
            raise ValueError(f"TrafficSpec.source must be 'zipf' or 'criteo', got {self.source!r}")


def _check_preset(preset: str) -> None:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; use one of {sorted(PRESETS)}")


def table_cardinalities(preset: str) -> list[int]:
    """Rows per table of a preset, in C1..C26 order.

    Args:
        preset: ``"criteo_kaggle"`` (raw Kaggle counts) or ``"criteo_1tb"`` (TorchRec/MLPerf
            sizes: raw 1TB counts capped at 40M).

    Returns:
        26 cardinalities.
    """
    _check_preset(preset)
    return list(PRESETS[preset])


# ------------------------------------------------------------------------------------------------
# Skew: truncated Zipf over popularity ranks
# ------------------------------------------------------------------------------------------------


def zipf_alpha(cardinality: int) -> float:
    """Zipf exponent of a table: ``1 + 9.957 / ln(N) ** 2.327``, capped at 30.

    Small tables are far more skewed than large ones. The two constants are solved so that a
    3-row table has about 2 distinct ids in a 2,048-row batch and a 36,000-row table about 945.

    Args:
        cardinality: Rows in the table (``N``).

    Returns:
        The exponent ``alpha`` of ``P(rank k) ~ k ** -alpha``.
    """
    if cardinality < 1:
        raise ValueError(f"cardinality must be >= 1, got {cardinality}")
    if cardinality == 1:
        return _ALPHA_MAX
    return min(_ALPHA_MAX, 1.0 + _ALPHA_B / math.log(cardinality) ** _ALPHA_K)


@functools.lru_cache(maxsize=256)
def _zipf_tables(cardinality: int, alpha: float) -> tuple[torch.Tensor, float, float]:
    """Exact head CDF (unnormalised, float64), tail mass and total mass of a truncated Zipf."""
    head = min(cardinality, _HEAD_RANKS)
    ranks = torch.arange(1, head + 1, dtype=torch.float64)
    head_cdf = torch.cumsum(ranks.pow(-alpha), 0)
    tail_mass = _power_integral(head + 0.5, cardinality + 0.5, alpha) if cardinality > head else 0.0
    return head_cdf, tail_mass, float(head_cdf[-1]) + tail_mass


def _power_integral(lo: float, hi: float, alpha: float) -> float:
    """Integral of x ** -alpha over [lo, hi]."""
    if abs(alpha - 1.0) < 1e-12:
        return math.log(hi / lo)
    return (hi ** (1.0 - alpha) - lo ** (1.0 - alpha)) / (1.0 - alpha)


def zipf_pmf(ids: torch.Tensor, cardinality: int, alpha: float | None = None) -> torch.Tensor:
    """Probability of each id under the table's truncated Zipf law (id ``k`` has rank ``k + 1``).

    Args:
        ids: Integer tensor of ids in ``[0, cardinality)``.
        cardinality: Rows in the table.
        alpha: Zipf exponent; ``None`` takes :func:`zipf_alpha`.

    Returns:
        float64 tensor of the ids' shape.
    """
    alpha = zipf_alpha(cardinality) if alpha is None else alpha
    _, _, total = _zipf_tables(cardinality, alpha)
    return (ids.to(torch.float64) + 1.0).pow(-alpha) / total


def sample_ids(
    cardinality: int,
    n: int,
    generator: torch.Generator | None = None,
    alpha: float | None = None,
) -> torch.Tensor:
    """Draw ``n`` ids from a table's truncated Zipf law by inverse CDF.

    Ids are popularity ranks minus one: id 0 is the most frequent. The first 65,536 ranks use the
    exact discrete CDF; the tail of a larger table uses the continuous power law on
    ``[65536.5, N + 0.5)`` rounded to the nearest rank, so no per-row array of size ``N`` exists.

    Args:
        cardinality: Rows in the table.
        n: Number of ids.
        generator: Source of randomness (for reproducibility).
        alpha: Zipf exponent; ``None`` takes :func:`zipf_alpha`.

    Returns:
        int64 tensor ``[n]`` of ids in ``[0, cardinality)``.
    """
    alpha = zipf_alpha(cardinality) if alpha is None else alpha
    head_cdf, tail_mass, total = _zipf_tables(cardinality, alpha)
    head_mass = total - tail_mass
    t = torch.rand(n, generator=generator, dtype=torch.float64) * total
    ranks = torch.searchsorted(head_cdf, t, right=True).clamp_(max=head_cdf.numel() - 1) + 1
    in_tail = t >= head_mass
    if bool(in_tail.any()):
        v = (t[in_tail] - head_mass) / tail_mass
        lo, hi = head_cdf.numel() + 0.5, cardinality + 0.5
        if abs(alpha - 1.0) < 1e-12:
            x = torch.exp(math.log(lo) + v * math.log(hi / lo))
        else:
            e = 1.0 - alpha
            x = (lo**e + v * (hi**e - lo**e)).pow(1.0 / e)
        ranks[in_tail] = (
            torch.floor(x + 0.5).to(torch.int64).clamp_(head_cdf.numel() + 1, cardinality)
        )
    return ranks - 1


# ------------------------------------------------------------------------------------------------
# Values: counter-based hash -> trained-looking rows
# ------------------------------------------------------------------------------------------------


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (numpy wraps uint64 arithmetic, as intended)."""
    z = x + _GOLDEN
    z = (z ^ (z >> _U64(30))) * _MIX1
    z = (z ^ (z >> _U64(27))) * _MIX2
    return z ^ (z >> _U64(31))


def _key(*parts: int) -> np.ndarray:
    """Hash a tuple of non-negative ints into one uint64 (as a 1-element array)."""
    h = np.zeros(1, dtype=_U64)
    for p in parts:
        h = _splitmix64(h ^ np.array([p & 0xFFFFFFFFFFFFFFFF], dtype=_U64))
    return h


def _uniform(keys: np.ndarray, stream: int, width: int) -> np.ndarray:
    """Uniforms in (0, 1), shape ``keys.shape + (width,)``, one per (key, stream, column)."""
    cols = _splitmix64((np.arange(width, dtype=_U64) << _U64(8)) | _U64(stream))
    h = _splitmix64(keys[..., None] ^ cols)
    return ((h >> _U64(11)).astype(np.float64) + 0.5) * 2.0**-53


def _normal(keys: np.ndarray, stream: int, width: int) -> torch.Tensor:
    """Standard normals from :func:`_uniform` through the inverse normal CDF (float64)."""
    return torch.special.ndtri(torch.from_numpy(_uniform(keys, stream, width)))


def embedding_rows(
    table_idx: int,
    ids: torch.Tensor,
    dim: int,
    cardinality: int,
    seed: int = 0,
    model: ValueModel | None = None,
) -> torch.Tensor:
    """Rows of a trained-looking embedding table, generated only for the ids asked for.

    The row of an id depends only on ``(seed, table_idx, id, dim, cardinality, model)``: asking
    twice, or in another batch, gives the same values bit for bit.

    Args:
        table_idx: Table number (selects the table's own random stream and shared structure).
        ids: Integer tensor ``[n]`` of ids (popularity ranks) in ``[0, cardinality)``.
        dim: Embedding dimension.
        cardinality: Rows in the table (sets the init scale and the ids' popularity).
        seed: Seed of the values.
        model: Value model; ``None`` takes ``ValueModel()`` (a Kaggle-epoch model).

    Returns:
        float32 tensor ``[n, dim]``.
    """
    model = ValueModel() if model is None else model
    ids = ids.reshape(-1).to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cardinality):
        raise ValueError(
            f"ids must lie in [0, {cardinality}) for table {table_idx}; got range "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )
    uniq, inverse = torch.unique(ids, return_inverse=True)
    table_key = _key(seed, table_idx)
    row_keys = _splitmix64(table_key ^ _splitmix64(uniq.numpy().astype(_U64)))

    scale = 1.0 / math.sqrt(cardinality)
    init = scale * (2.0 * torch.from_numpy(_uniform(row_keys, _STREAM_INIT, dim)) - 1.0)

    basis = _normal(table_key, _STREAM_BASIS, model.rank * dim).reshape(model.rank, dim)
    mean = _normal(table_key, _STREAM_MEAN, dim).reshape(dim)
    coef = _normal(row_keys, _STREAM_COEF, model.rank)
    shared = coef @ basis / math.sqrt(model.rank)
    v = torch.from_numpy(_uniform(row_keys, _STREAM_NOISE, dim)) - 0.5
    laplace = -torch.sign(v) * torch.log1p(-2.0 * v.abs()) / math.sqrt(2.0)
    f = model.low_rank_fraction
    drift = math.sqrt(f) * shared + math.sqrt(1.0 - f) * laplace + model.mean_shift * mean

    s = model.row_scale_sigma
    gain = model.drift_scale * torch.exp(s * _normal(row_keys, _STREAM_SCALE, 1) - 0.5 * s * s)
    count = model.trained_samples * zipf_pmf(uniq, cardinality)
    weight = (count / (count + model.half_drift_count)).unsqueeze(1)
    rows = init + weight * gain * drift
    return rows.to(torch.float32)[inverse]


# ------------------------------------------------------------------------------------------------
# Real Criteo rows
# ------------------------------------------------------------------------------------------------


def criteo_sample_ids(path: str | Path | None = None, preset: str = "criteo_1tb") -> torch.Tensor:
    """Ids of the 26 categorical features of real Criteo rows.

    Each hex feature value is hashed as ``int(value, 16) % cardinality``; a missing value
    (empty field) becomes id 0.

    Args:
        path: Criteo TSV file, gzipped or not (label, 13 integer, 26 hex categorical columns);
            default :data:`DEFAULT_CRITEO_SAMPLE`.
        preset: Table sizes to hash into.

    Returns:
        int64 tensor ``[rows, 26]``.
    """
    cards = table_cardinalities(preset)
    return torch.from_numpy(_read_criteo(str(path or DEFAULT_CRITEO_SAMPLE), tuple(cards))).clone()


@functools.lru_cache(maxsize=8)
def _read_criteo(path: str, cards: tuple[int, ...]) -> np.ndarray:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"Criteo sample {p} not found; pass the path of a Criteo TSV(.gz) file"
        )
    opener = gzip.open if p.suffix == ".gz" else open
    first = 1 + 13
    out: list[list[int]] = []
    with opener(p, "rt") as fh:
        for lineno, line in enumerate(fh, 1):
            fields = line.rstrip("\r\n").split("\t")
            if len(fields) != first + NUM_SPARSE_FEATURES:
                raise ValueError(
                    f"{p}:{lineno}: expected {first + NUM_SPARSE_FEATURES} tab-separated fields "
                    f"(label, 13 integer, 26 categorical), got {len(fields)}"
                )
            out.append(
                [int(v, 16) % c if v else 0 for v, c in zip(fields[first:], cards, strict=True)]
            )
    return np.asarray(out, dtype=np.int64).reshape(-1, NUM_SPARSE_FEATURES)


def frequency_ranks(ids: torch.Tensor) -> torch.Tensor:
    """Replace each id by its popularity rank among ``ids`` (0 = most frequent).

    Ties are broken by the smaller id. Real ids carry no popularity; ranking them by frequency in
    the sample lets :func:`embedding_rows` give frequent values their drifted rows.

    Args:
        ids: Integer tensor ``[n]``.

    Returns:
        int64 tensor ``[n]``.
    """
    uniq, inverse, counts = torch.unique(ids.reshape(-1), return_inverse=True, return_counts=True)
    # Stable sort by count, descending, over ids sorted ascending: ties keep the smaller id first.
    order = torch.sort(counts, descending=True, stable=True).indices
    rank_of = torch.empty_like(order)
    rank_of[order] = torch.arange(uniq.numel())
    return rank_of[inverse]


# ------------------------------------------------------------------------------------------------
# Blocks and bounds
# ------------------------------------------------------------------------------------------------


def _batch_ids(spec: TrafficSpec, cards: Sequence[int]) -> list[torch.Tensor]:
    """Per-table ids (popularity ranks) of the spec's batch."""
    if spec.source == "zipf":
        ids = []
        for t, card in enumerate(cards):
            gen = torch.Generator().manual_seed(int(_key(spec.seed, spec.batch, t)[0] >> _U64(1)))
            ids.append(sample_ids(card, spec.batch_rows, gen))
        return ids
    sample = criteo_sample_ids(spec.criteo_path, spec.preset)
    start, stop = spec.batch * spec.batch_rows, (spec.batch + 1) * spec.batch_rows
    if stop > sample.shape[0]:
        raise ValueError(
            f"the Criteo sample has {sample.shape[0]} rows; batch {spec.batch} of "
            f"{spec.batch_rows} rows needs {stop}. Use batch_rows * (batch + 1) <= "
            f"{sample.shape[0]}"
        )
    # Rank over the whole file, so that a value keeps its row in every batch.
    return [frequency_ranks(sample[:, t])[start:stop] for t in range(NUM_SPARSE_FEATURES)]


def make_blocks(spec: TrafficSpec) -> list[torch.Tensor]:
    """One batch of forward all-to-all traffic: one pooled-embedding block per table.

    Args:
        spec: What to generate.

    Returns:
        26 float32 tensors ``[spec.batch_rows, spec.dim]``, in C1..C26 order.
    """
    cards = table_cardinalities(spec.preset)
    model = spec.value_model or default_value_model(spec.preset)
    return [
        embedding_rows(t, ids, spec.dim, card, spec.seed, model)
        for t, (ids, card) in enumerate(zip(_batch_ids(spec, cards), cards, strict=True))
    ]


def relative_to_absolute_bounds(
    blocks: Sequence[torch.Tensor], eb_rel: float | Sequence[float]
) -> list[float]:
    """Absolute error bounds ``eb_rel * (max - min)`` per block, as in the paper.

    The range is taken in float64 from the blocks' float values. A constant block gets bound 0.

    Args:
        blocks: Tensors, one per table.
        eb_rel: One relative bound for all blocks, or one per block.

    Returns:
        One absolute bound per block.
    """
    rel = [float(eb_rel)] * len(blocks) if isinstance(eb_rel, (int, float)) else list(eb_rel)
    if len(rel) != len(blocks):
        raise ValueError(f"got {len(rel)} relative bounds for {len(blocks)} blocks")
    out = []
    for b, r in zip(blocks, rel, strict=True):
        if b.numel() == 0:
            out.append(0.0)
            continue
        out.append(r * (float(b.max()) - float(b.min())))
    return out


def paper_class_bounds(
    preset: str, tight: float = 0.01, base: float = 0.03, loose: float = 0.05
) -> list[float]:
    """Relative bounds of the paper's three table classes, assigned by cardinality.

    Tables with at least :data:`TIGHT_MIN_ROWS` (100,000) rows are tight, those with fewer than
    :data:`LOOSE_MAX_ROWS` (1,000) loose, the rest base. This fixed split stands in for the paper's
    homogenization index in benchmarks only.

    Args:
        preset: Table sizes.
        tight: Bound of the largest tables.
        base: Bound of the middle tables.
        loose: Bound of the smallest tables.

    Returns:
        26 relative bounds, in C1..C26 order.
    """
    return [
        tight if c >= TIGHT_MIN_ROWS else loose if c < LOOSE_MAX_ROWS else base
        for c in table_cardinalities(preset)
    ]


def paper_traffic(spec: TrafficSpec) -> tuple[list[torch.Tensor], list[float]]:
    """The blocks of ``spec`` and their absolute bounds at the paper's class bounds.

    Args:
        spec: Traffic to generate.

    Returns:
        (one block per table, one absolute bound per block).
    """
    blocks = make_blocks(spec)
    return blocks, relative_to_absolute_bounds(blocks, paper_class_bounds(spec.preset))
