"""Does a predictor lower the entropy of quantized embedding traffic? (It does not.)

For each table block of the realistic traffic, at the paper's class bounds, the order-0 entropy
of the codes of the distinct quantized vectors (what the Huffman stage codes after vector-LZ) is
compared with the entropy of the residuals of three predictors: the previous element of the same
vector, the same element of the previous distinct vector, and the vector's rounded mean.

Usage:
    python benchmarks/predictor_study.py [--rows 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from torchrec_lossy.traffic import (
    TrafficSpec,
    make_blocks,
    paper_class_bounds,
    relative_to_absolute_bounds,
)


def order0_entropy(values: np.ndarray) -> float:
    """Order-0 entropy in bits per value.

    Args:
        values: Integer array.

    Returns:
        Entropy in bits.
    """
    _, counts = np.unique(values, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def residuals(codes: np.ndarray) -> dict[str, np.ndarray]:
    """Codes and the residuals of each candidate predictor.

    Args:
        codes: [n_vectors, dim] integer codes, vectors in first-occurrence order.

    Returns:
        Name -> residual array.
    """
    return {
        "none": codes,
        "previous element": np.diff(codes, axis=1, prepend=0),
        "previous vector": np.diff(codes, axis=0, prepend=0),
        "vector mean": codes - np.round(codes.mean(axis=1, keepdims=True)).astype(codes.dtype),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    results = {}
    for preset, dim in (("criteo_kaggle", 32), ("criteo_1tb", 64)):
        blocks = make_blocks(TrafficSpec(preset=preset, dim=dim, batch_rows=args.rows))
        bounds = relative_to_absolute_bounds(blocks, paper_class_bounds(preset))
        bits: dict[str, float] = {}
        n_codes = 0
        for block, bound in zip(blocks, bounds, strict=True):
            if bound <= 0:
                continue
            q = torch.floor(block / (2 * bound) + 0.5).long().numpy()
            _, first = np.unique(q, axis=0, return_index=True)
            distinct = q[np.sort(first)]
            for name, r in residuals(distinct).items():
                bits[name] = bits.get(name, 0.0) + order0_entropy(r.ravel()) * r.size
            n_codes += distinct.size
        results[preset] = {name: b / n_codes for name, b in bits.items()}
        row = ", ".join(f"{name}: {v:.3f}" for name, v in results[preset].items())
        print(f"{preset} (dim {dim}, {args.rows} rows), bits per code -> {row}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
