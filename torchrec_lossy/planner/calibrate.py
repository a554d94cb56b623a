"""Calibration: the real codec's ratio on sample traffic of each table.

:func:`calibrate` compresses one sample block per table at the bound the table would get in
steady state (its homogenization class when that is on, decay factor 1) and reports raw and wire
bytes. The blocks come from a real model and batch (:func:`pooled_blocks`) or from the
Criteo-like traffic model (:func:`synthetic_blocks`, for configs of tables that do not exist yet).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchrec_lossy.adaptive import AdaptiveBounds
from torchrec_lossy.config import EmbeddingTableConfig, ErrorBound, LossyCommsConfig

__all__ = ["Calibration", "calibrate", "pooled_blocks", "synthetic_blocks"]


@dataclass(frozen=True)
class Calibration:
    """The codec on one table's sample block.

    Attributes:
        table: Table name.
        rows: Rows of the block.
        dim: Columns of the block.
        raw_bytes: Bytes of the block.
        wire_bytes: Bytes of its payload (header included).
        bound: The bound it was compressed with.
        abs_bound: That bound in absolute terms.
        table_class: Homogenization class (``"unassigned"`` when homogenization is off).
        index: Homogenization index of the block (None when homogenization is off).
    """

    table: str
    rows: int
    dim: int
    raw_bytes: int
    wire_bytes: int
    bound: ErrorBound
    abs_bound: float
    table_class: str
    index: float | None

    @property
    def ratio(self) -> float:
        """Raw bytes / wire bytes."""
        return self.raw_bytes / self.wire_bytes


def _abs_bound(block: torch.Tensor, bound: ErrorBound) -> float:
    if bound.mode == "absolute":
        return bound.value
    finite = block[torch.isfinite(block)]
    if finite.numel() == 0:
        return 0.0
    return bound.value * (float(finite.max()) - float(finite.min()))


def calibrate(
    blocks: Mapping[str, torch.Tensor], comms: LossyCommsConfig
) -> dict[str, Calibration]:
    """Runs the codec on each table's sample block at its steady-state bound.

    Tables with ``compress: false`` are reported at ratio 1 (raw bytes on the wire).

    Args:
        blocks: One 2-D pooled-embedding block per table name.
        comms: The comms config (bounds, overrides, homogenization, codec knobs).

    Returns:
        Per-table results, in the order of ``blocks``.
    """
    from torchrec_lossy.codec import BoundKind, compress, compress_with_stats

    names = list(blocks)
    adaptive = AdaptiveBounds(names, comms)
    if comms.homogenization.enabled:
        for name in names:
            adaptive.update_index(name, blocks[name])
    adaptive.eval()  # steady state: decay factor 1
    out = {}
    for name in names:
        block = blocks[name].detach()
        if block.dim() != 2 or block.shape[0] == 0:
            raise ValueError(
                f"calibrate: the block of table {name!r} must be a non-empty 2-D tensor, got "
                f"shape {tuple(block.shape)}"
            )
        raw = block.numel() * block.element_size()
        bound = adaptive.bound(name)
        if comms.table(name).compress and bound.mode == "value":  # no absolute form
            payload, _ = compress_with_stats(
                [block], [bound.value], comms.codec, kinds=[BoundKind.VALUE]
            )
            eb, wire = bound.value, int(payload.numel())
        elif comms.table(name).compress:
            eb = _abs_bound(block, bound)
            wire = int(compress([block], [eb], comms.codec).numel())
        else:
            eb, wire = 0.0, raw
        tel = adaptive.telemetry()[name]
        out[name] = Calibration(
            table=name,
            rows=block.shape[0],
            dim=block.shape[1],
            raw_bytes=raw,
            wire_bytes=wire,
            bound=bound,
            abs_bound=eb,
            table_class=tel["class"],
            index=tel["index"],
        )
    return out


def pooled_blocks(module: Any, features: Any) -> dict[str, torch.Tensor]:
    """Pooled embeddings of a real batch, per table: the traffic the forward all-to-all carries.

    Args:
        module: A TorchRec ``EmbeddingBagCollection`` with materialised weights.
        features: A ``KeyedJaggedTensor`` batch for it.

    Returns:
        ``{table: [batch * features_of_table, dim]}`` (a table's features stacked by rows).
    """
    with torch.no_grad():
        pooled = module(features).to_dict()
    return {
        cfg.name: torch.cat([pooled[f] for f in cfg.feature_names])
        for cfg in module.embedding_bag_configs()
    }


def synthetic_blocks(
    tables: Sequence[EmbeddingTableConfig],
    batch_rows: int,
    seed: int = 0,
    trained_samples: float | None = None,
) -> dict[str, torch.Tensor]:
    """Criteo-like pooled embeddings for tables that exist only in a config.

    Ids follow :mod:`torchrec_lossy.traffic`'s size-dependent Zipf law and rows its
    trained-model value model, so a 40M-row table costs only the looked-up rows.

    Args:
        tables: The tables (their sizes and dims).
        batch_rows: Rows per block.
        seed: Seed of ids and values.
        trained_samples: Samples the modelled model has trained on; None: one Kaggle epoch.

    Returns:
        ``{table: [batch_rows, dim]}`` float32 blocks.
    """
    from torchrec_lossy import traffic

    model = (
        traffic.ValueModel()
        if trained_samples is None
        else traffic.ValueModel(trained_samples=trained_samples)
    )
    out = {}
    for i, t in enumerate(tables):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
        ids = traffic.sample_ids(t.num_embeddings, batch_rows, gen)
        out[t.name] = traffic.embedding_rows(
            i, ids, t.embedding_dim, t.num_embeddings, seed=seed, model=model
        )
    return out
