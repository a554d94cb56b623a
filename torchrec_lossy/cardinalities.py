"""Published per-feature table sizes of the Criteo click-log data sets.

The lists are in C1..C26 order, as the categorical columns appear in the raw files. They size
synthetic tables like the real ones. Other published variants (1TB after hashing mod 40M or
10M, frequency thresholds 3 and 15) differ per source; each list below names its own.
"""

from __future__ import annotations

# Criteo Kaggle Display Advertising Challenge, raw distinct values per feature (no frequency
# threshold). Source: facebookresearch/dlrm, tools/visualize.py (kaggle branch).
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip

# Criteo 1TB Click Logs, the table sizes TorchRec's and MLPerf's DLRM use: raw distinct values
# capped at 40M rows (ids hashed mod 40M). Sources: facebookresearch/dlrm torchrec_dlrm/README.MD
# (--num_embeddings_per_feature); torchrec examples/nvt_dataloader/README.md.
CRITEO_1TB_CARDINALITIES: tuple[int, ...] = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)  # fmt: skip

PRESETS: dict[str, tuple[int, ...]] = {
    "criteo_kaggle": CRITEO_KAGGLE_CARDINALITIES,
    "criteo_1tb": CRITEO_1TB_CARDINALITIES,
}

# Number of categorical features (tables) in both data sets.
NUM_SPARSE_FEATURES = 26
