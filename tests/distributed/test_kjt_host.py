"""The KJT codec's compiled CPU path (``kjt_host``) against its torch path, the oracle.

Both backends must give the same words (payloads, metadata, checksums) and the same decoded
tensors, byte for byte, on random KJTs: weights (raw and cast), wire dedupe on and off, both
output dedupe modes, empty features, several destinations (one without features), int32 and
int64 KJTs, ids over 32 bits and ids too wide for the radix sort's packed records.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torchrec import KeyedJaggedTensor

from torchrec_lossy.config import InputDistConfig
from torchrec_lossy.distributed import LossyAllToAllError
from torchrec_lossy.distributed.kjt_codec import (
    DecodedKJT,
    EncodedKJT,
    decode_kjt,
    encode_kjt,
    on_host,
    parse_meta,
)
from torchrec_lossy.distributed.kjt_layout import FeatureMeta

ENCODED_FIELDS = (
    "send",
    "send_words",
    "meta",
    "meta_splits",
    "num_ids_per_dest",
    "expand",
    "features",
    "feature_stats",
    "feature_bytes",
    "wire_weights",
)


def _random_kjt(
    g: torch.Generator, num_features: int, batch: int, case: str, dtype: torch.dtype, weighted: bool
) -> KeyedJaggedTensor:
    """A KJT whose first feature is empty; ``case`` picks the bag lengths and id range."""
    if case == "single_hot":
        lengths = torch.ones(num_features * batch, dtype=torch.int64)
    elif case == "zero_or_one":
        lengths = torch.randint(0, 2, (num_features * batch,), generator=g)
    else:
        lengths = torch.randint(0, 5, (num_features * batch,), generator=g)
    lengths[:batch] = 0
    n = int(lengths.sum())
    rows = {"wide": 2**40, "widest": 2**62}.get(case, 1000)
    if dtype == torch.int32:
        rows = min(rows, 2**31 - 1)
    # Skewed toward 0, so that ids repeat and deduplication pays.
    values = (torch.rand(n, generator=g, dtype=torch.float64) ** 3 * rows).long()
    if case == "multi_hot":  # a strided view, as a KJT may hold
        values = values.repeat_interleave(2)[::2]
    weights = torch.randn(n, generator=g) if weighted else None
    return KeyedJaggedTensor(
        keys=[f"f{i}" for i in range(num_features)],
        values=values.to(dtype),
        lengths=lengths.to(dtype),
        weights=weights,
        stride=batch,
    )


def _assert_same(a: Any, b: Any, what: str) -> None:
    """Equal values, dtypes and structure (tensors compared element for element)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, what
        assert torch.equal(a, b), what
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{what}[{i}]")
    else:
        assert a == b, what


def _decode_args(enc: EncodedKJT, splits: list[int], dest: int) -> tuple:
    """What destination ``dest`` passes to ``decode_kjt`` (one source: ``enc``'s rank)."""
    words = list(itertools.accumulate(enc.send_words, initial=0))
    metas = list(itertools.accumulate(enc.meta_splits, initial=0))
    row = parse_meta(enc.meta[metas[dest] : metas[dest + 1]].tolist(), splits[dest])
    recv = enc.send[words[dest] : words[dest + 1]].clone()
    keys = [f"k{i}" for i in range(splits[dest])]
    return recv, [enc.send_words[dest]], [row.features], [row.batch], [row.codes], keys, 0


CASES = ["multi_hot", "single_hot", "zero_or_one", "wide", "widest"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dedupe", [True, False])
@pytest.mark.parametrize("output_dedupe", [None, "exact", "lookup"])
def test_numba_path_equals_torch_path_byte_for_byte(
    case: str, dedupe: bool, output_dedupe: str | None
) -> None:
    g = torch.Generator().manual_seed(CASES.index(case) * 10 + dedupe)
    for trial in range(6):
        weighted = trial % 3 == 0 and output_dedupe is None
        dtype = torch.int32 if trial % 2 else torch.int64
        batch = [1, 5, 64, 0, 300, 17][trial]
        splits = [[3, 0, 2], [5], [1, 1, 1, 2], [2, 3], [4, 1], [0, 5]][trial]
        kjt = _random_kjt(g, sum(splits), batch, case, dtype, weighted)
        config = InputDistConfig(
            dedupe=dedupe,
            weights=("none", "fp16", "bf16")[trial % 3] if weighted else "none",
            checksum=trial != 4,
        )
        encoded = {
            b: encode_kjt(kjt, splits, config, output_dedupe, backend=b)  # type: ignore[arg-type]
            for b in ("torch", "numba")
        }
        for name in ENCODED_FIELDS:
            what = f"{case} trial {trial}: {name}"
            _assert_same(getattr(encoded["torch"], name), getattr(encoded["numba"], name), what)
        for dest in range(len(splits)):
            args = _decode_args(encoded["torch"], splits, dest)
            want = decode_kjt(*args, backend="torch")
            got = decode_kjt(*args, backend="numba")
            _assert_same(tuple(want), tuple(got), f"{case} trial {trial}: decode of {dest}")
            # The decode is exact: the destination's features of the input KJT.
            part = kjt.split(splits)[dest]
            if output_dedupe != "lookup":
                assert torch.equal(got.lengths, part.lengths())
                assert torch.equal(got.values, part.values())


def test_numba_decode_refuses_fields_that_do_not_match_the_metadata() -> None:
    g = torch.Generator().manual_seed(7)
    kjt = _random_kjt(g, 2, 32, "multi_hot", torch.int64, weighted=False)
    enc = encode_kjt(kjt, [2], InputDistConfig(checksum=False), backend="numba")
    recv, *args = _decode_args(enc, [2], 0)
    recv[:] = -1  # right size, every field all ones: the lengths no longer sum to the ids
    with pytest.raises(LossyAllToAllError, match=r"from rank 0 .*lengths do not sum to its ids"):
        decode_kjt(recv, *args, backend="numba")

    # An inverse index past the distinct ids: one deduplicated feature of one bag of 2 ids and
    # 3 distinct ids (2-bit lengths, 1-bit ids, 2-bit inverse index), in one word.
    meta = FeatureMeta(len_bits=2, id_bits=1, dedupe=True, num_ids=2, num_unique=3)
    codes = args[-3]  # int64 lengths and ids, no checksum

    def decode(inverse: list[int]) -> DecodedKJT:
        word = 2 | 0b101 << 2 | inverse[0] << 5 | inverse[1] << 7  # bags [2], distinct [1, 0, 1]
        words = torch.tensor([word], dtype=torch.int32)
        return decode_kjt(words, [1], [[meta]], [1], codes, ["k"], 0, backend="numba")

    with pytest.raises(
        LossyAllToAllError,
        match=r"from rank 0 .*feature 0 of the payload: its inverse index points past its",
    ):
        decode([3, 0])
    out = decode([2, 0])  # in range
    assert out.lengths.tolist() == [2] and out.values.tolist() == [1, 1]


def test_backend_names_and_devices_are_checked() -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert on_host(cpu, "auto") and on_host(cpu, "numba") and not on_host(cpu, "torch")
    assert not on_host(meta, "auto")
    with pytest.raises(ValueError, match="runs on CPU tensors"):
        on_host(meta, "numba")
    with pytest.raises(ValueError, match="'auto', 'torch' or 'numba'"):
        on_host(cpu, "gpu")  # type: ignore[arg-type]
