"""Tests of the lossless packed KJT input dist: bit packing, format, and exactness against TorchRec.

Single-process tests simulate the exchange (what each source sends to a destination is cut out
of its send buffer); multi-process tests compare with TorchRec's ``KJTAllToAll`` and sharder.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import pytest
import torch
from harness import (
    EXACT_BACKWARD,
    SHARDER_TABLES,
    load_full_weights,
    local_weights,
    make_batch,
    make_ebc,
    make_tables,
    manual_plan,
    run_workers,
    sharder_plan,
    skewed_batch,
    train_step,
)
from torchrec.distributed.dist_data import KJTAllToAllTensorsAwaitable, _get_recat

from torchrec_lossy.config import ConfigError, InputDistConfig, LossyCommsConfig
from torchrec_lossy.distributed import LossyAllToAllError, LossyComms, StaticBounds
from torchrec_lossy.distributed.dedupe import distinct_bags, first_bags, segment_sort
from torchrec_lossy.distributed.input_dist import SPLITS, encode_with_telemetry, torchrec_recat
from torchrec_lossy.distributed.kjt_codec import decode_kjt, parse_meta
from torchrec_lossy.distributed.kjt_torch import pack_bits, payload_checksums, unpack_bits

KEYS = ["a", "b", "c", "d", "e"]


def _comms(**input_dist: Any) -> LossyComms:
    config = LossyCommsConfig(input_dist=InputDistConfig(**input_dist))
    return LossyComms(config=config, bounds=StaticBounds([], config))


def _kjt(
    case: str, batch: int, seed: int, keys: list[str] = KEYS, dtype: torch.dtype = torch.int64
) -> Any:
    """One rank's KJT for a named case (ids skewed toward 0 unless the case says otherwise)."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    f = len(keys)
    rows = 1000
    if case == "single_hot":
        lengths = torch.ones(f * batch, dtype=torch.int64)
    else:
        lengths = torch.randint(0, 5, (f * batch,), generator=g)
    if case == "empty":
        lengths[: 2 * batch] = 0  # two features without any id
        lengths[-batch:] = 0
    n = int(lengths.sum())
    values = (torch.rand(n, generator=g) ** 3 * rows).long()
    if case == "last_row":
        values[::2] = rows - 1
    if case == "wide":  # ids beyond 32 bits (a 2**40-row table)
        values = values * (2**30) + (2**40 - 1) * (torch.rand(n, generator=g) < 0.3)
    if case == "skewed":  # a few hot ids of a large table
        hot = torch.tensor([7, 999, 123_456, 2**20 - 1])
        values = hot[(torch.rand(n, generator=g) ** 2 * 4).long()]
    weights = torch.randn(n, generator=g) if case == "weighted" else None
    return KeyedJaggedTensor(
        keys=keys, values=values.to(dtype), lengths=lengths.to(dtype), weights=weights
    )


def _loopback(kjts: list[Any], splits: list[int], comms: LossyComms) -> list[tuple]:
    """Encodes every source's KJT and decodes what each destination would receive."""
    encs = [encode_with_telemetry(k, splits, comms) for k in kjts]
    out = []
    for r in range(len(splits)):
        recv, words, metas, strides, codes = [], [], [], [], []
        for e in encs:
            wo = list(itertools.accumulate(e.send_words, initial=0))
            mo = list(itertools.accumulate(e.meta_splits, initial=0))
            recv.append(e.send[wo[r] : wo[r + 1]])
            words.append(e.send_words[r])
            row = e.meta[mo[r] : mo[r + 1]].tolist()
            strides.append(row[1])
            codes.append(row[2])
            metas.append(parse_meta(row, splits[r]).features)
        keys = KEYS[sum(splits[:r]) : sum(splits[: r + 1])]
        out.append(decode_kjt(torch.cat(recv), words, metas, strides, codes, keys, r)[:3])
    return out


def test_pack_unpack_roundtrip_all_widths() -> None:
    g = torch.Generator().manual_seed(0)
    widths = torch.randint(1, 33, (4000,), generator=g)
    widths[:64] = torch.arange(1, 33).repeat(2)
    top = (1 << widths) - 1
    values = (torch.rand(4000, generator=g, dtype=torch.float64) * (top + 1)).long().minimum(top)
    values[:32] = top[:32]  # all-ones fields straddling words
    positions = torch.cumsum(widths, 0) - widths + 7  # an unaligned start
    num_words = int(positions[-1] + widths[-1] + 31) // 32
    words = pack_bits(values, widths, positions, num_words)
    assert words.dtype == torch.int32 and words.numel() == num_words
    assert torch.equal(unpack_bits(words, widths, positions), values)


@pytest.mark.parametrize(
    "case", ["single_hot", "multi_hot", "weighted", "empty", "last_row", "wide", "skewed"]
)
@pytest.mark.parametrize("dedupe", [True, False])
def test_loopback_is_exact(case: str, dedupe: bool) -> None:
    splits = [2, 0, 3]  # a destination with no features at all
    kjts = [_kjt(case, batch, seed) for seed, batch in enumerate([6, 3, 9])]
    comms = _comms(dedupe=dedupe)
    for r, (lengths, values, weights) in enumerate(_loopback(kjts, splits, comms)):
        parts = [k.split(splits)[r] for k in kjts]
        assert torch.equal(lengths, torch.cat([p.lengths() for p in parts])), r
        assert torch.equal(values, torch.cat([p.values() for p in parts])), r
        if case == "weighted":
            assert torch.equal(weights, torch.cat([p.weights() for p in parts])), r
        else:
            assert weights is None
    total = comms.stats.total("input")
    assert total.wire_bytes < total.raw_bytes
    if dedupe and case == "skewed":
        assert comms.stats.total("input").repeated_share > 0.5


def test_int32_dtypes_weight_cast_and_dedupe_saves_bytes() -> None:
    splits = [3, 2]
    kjts = [_kjt("weighted", 8, s, dtype=torch.int32) for s in range(2)]
    for r, (lengths, values, weights) in enumerate(_loopback(kjts, splits, _comms(weights="fp16"))):
        parts = [k.split(splits)[r] for k in kjts]
        assert lengths.dtype == values.dtype == torch.int32
        assert torch.equal(values, torch.cat([p.values() for p in parts]))
        expected = torch.cat([p.weights() for p in parts]).half().float()
        assert weights.dtype == torch.float32 and torch.equal(weights, expected)

    skewed = [_kjt("skewed", 64, s) for s in range(2)]
    on, off = _comms(dedupe=True), _comms(dedupe=False)
    _loopback(skewed, splits, on)
    _loopback(skewed, splits, off)
    assert on.stats.total("input").wire_bytes < off.stats.total("input").wire_bytes
    a = on.stats.table("a", "input")
    assert a.ids == sum(int(k["a"].lengths().sum()) for k in skewed)
    assert a.repeated_share > 0.9
    # Metadata is accounted separately from the features (and against TorchRec's splits).
    assert on.stats.table(SPLITS, "input").raw_bytes == 2 * 2 * 3 * 8  # senders, dests, rows


def _vbe_kjt(seed: int, keys: list[str] = KEYS, weighted: bool = False) -> Any:
    """A VBE KJT: every feature its own batch (one of them 0), ids skewed toward 0."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    strides = torch.randint(1, 8, (len(keys),), generator=g).tolist()
    strides[seed % len(keys)] = 0  # a feature without bags on this rank
    lengths = torch.randint(0, 4, (sum(strides),), generator=g)
    n = int(lengths.sum())
    return KeyedJaggedTensor(
        keys=keys,
        values=(torch.rand(n, generator=g) ** 3 * 1000).long(),
        lengths=lengths,
        weights=torch.randn(n, generator=g) if weighted else None,
        stride_per_key_per_rank=[[b] for b in strides],
    )


def test_vbe_kjt_travels_padded_with_its_batches_appended_to_the_metadata() -> None:
    from torchrec import KeyedJaggedTensor

    from torchrec_lossy.distributed.kjt_codec import meta_words
    from torchrec_lossy.distributed.vbe import pad_vbe_lengths

    splits = [2, 3]
    kjt = _vbe_kjt(3, weighted=True)
    strides = kjt.stride_per_key()
    padded, batch = pad_vbe_lengths(kjt.lengths(), strides)
    assert batch == max(strides) and padded.numel() == len(KEYS) * batch
    fixed = KeyedJaggedTensor(
        keys=KEYS, values=kjt.values(), lengths=padded, weights=kjt.weights(), stride=batch
    )
    vbe_enc = encode_with_telemetry(kjt, splits, _comms())
    fixed_enc = encode_with_telemetry(fixed, splits, _comms())
    # The payloads are those of the padded fixed-batch KJT, word for word.
    assert torch.equal(vbe_enc.send, fixed_enc.send)
    assert vbe_enc.meta_splits == [meta_words(n, vbe=True) for n in splits] == [11, 15]
    vbe_rows = torch.split(vbe_enc.meta, vbe_enc.meta_splits)
    fixed_rows = torch.split(fixed_enc.meta, fixed_enc.meta_splits)
    for d, (v, f) in enumerate(zip(vbe_rows, fixed_rows, strict=True)):
        n = splits[d]
        # Same row but for the VBE flag (bit 33 of the dtype-codes word), then the batches.
        assert torch.equal(v[:2], f[:2]) and int(v[2]) == int(f[2]) | 1 << 33
        assert torch.equal(v[3 : 3 + 3 * n], f[3:])
        lo = sum(splits[:d])
        assert v[3 + 3 * n :].tolist() == strides[lo : lo + n]
        row = parse_meta(v.tolist(), n)
        assert row.strides == strides[lo : lo + n] and parse_meta(f.tolist(), n).strides is None
    with pytest.raises(ValueError, match="VBE"):
        encode_with_telemetry(kjt, splits, _comms(), output_dedupe="exact")


def test_negative_ids_and_mismatched_payload_are_refused() -> None:
    from torchrec import KeyedJaggedTensor

    bad = KeyedJaggedTensor(keys=["a"], values=torch.tensor([3, -1]), lengths=torch.tensor([2]))
    with pytest.raises(ValueError, match="negative id"):
        encode_with_telemetry(bad, [1], _comms())
    kjt = _kjt("multi_hot", 4, 0, keys=["a"])
    enc = encode_with_telemetry(kjt, [1], _comms())
    meta = enc.meta.tolist()
    fm = parse_meta(meta, 1).features
    with pytest.raises(LossyAllToAllError, match="words received"):
        decode_kjt(enc.send[:-1], [enc.send_words[0] - 1], [fm], [4], [meta[2]], ["a"], 0)
    with pytest.raises(ConfigError, match=r"input_dist\.weights"):
        InputDistConfig(weights="int8")  # type: ignore[arg-type]


def test_checksum_catches_a_flipped_word_and_costs_two_words_per_destination() -> None:
    kjt = _kjt("weighted", 6, 3)
    splits = [2, 3]
    on, off = (
        encode_with_telemetry(kjt, splits, _comms()),
        encode_with_telemetry(kjt, splits, _comms(checksum=False)),
    )
    assert [a - b for a, b in zip(on.send_words, off.send_words, strict=True)] == [2, 2]
    assert torch.equal(_loopback([kjt], splits, _comms())[1][1], kjt.values()[-_n_ids(kjt, 3) :])
    meta = on.meta.tolist()
    row = meta[on.meta_splits[0] :]  # destination 1
    fms = parse_meta(row, 3).features
    recv = on.send[on.send_words[0] :].clone()
    args = ([on.send_words[1]], [fms], [6], [row[2]], KEYS[2:], 1)
    decode_kjt(recv, *args)  # intact: decodes
    for word in (0, on.send_words[1] // 2, on.send_words[1] - 1):
        bad = recv.clone()
        bad[word] ^= 1 << 7
        with pytest.raises(LossyAllToAllError, match=r"from rank 0 .*checksum does not match"):
            decode_kjt(bad, *args)


def test_checksums_match_their_formula_across_payload_sizes() -> None:
    g = torch.Generator().manual_seed(3)
    sizes = [0, 1, 2, 3, 70_000, 17]
    words = torch.randint(-(2**31), 2**31, (sum(sizes),), generator=g, dtype=torch.int64)
    words = words.to(torch.int32)
    got = payload_checksums(words, sizes).tolist()
    at = 0
    for n, s in zip(sizes, got, strict=True):
        u = [w & 0xFFFFFFFF for w in words[at : at + max(n - 2, 0)].tolist()]
        # The codec's checksum (docs/format.md): weights 2 i + 1, sums modulo 2**64.
        want = sum(x * (2 * i + 1) for i, x in enumerate(u)) % 2**64
        assert s % 2**64 == want
        at += n


def test_owner_first_bags_from_the_inverse_index_equal_the_sort() -> None:
    g = torch.Generator().manual_seed(4)
    lengths, values, inverses, uniques = [], [], [], []
    for batch, card, p_empty in ((50, 7, 0.0), (64, 1000, 0.3), (9, 3, 0.9), (5, 4, 1.0)):
        lens = (torch.rand(batch, generator=g) >= p_empty).to(torch.int64)
        ids = torch.randint(0, card, (int(lens.sum()),), generator=g)
        u, inv = torch.unique(ids, sorted=True, return_inverse=True)
        lengths.append(lens)
        values.append(ids)
        inverses.append(inv)
        uniques.append(u.numel())
    want = distinct_bags(lengths, values)[2]
    for bound in (None, 1000):
        assert [t.tolist() for t in distinct_bags(lengths, values, bound)[2]] == [
            t.tolist() for t in want
        ]
    got = first_bags(lengths, inverses, uniques)
    assert [t.tolist() for t in got] == [t.tolist() for t in want]


def test_segment_sort_with_a_bound_is_the_two_sort_order() -> None:
    g = torch.Generator().manual_seed(5)
    keys = torch.randint(0, 50, (500,), generator=g)
    seg = torch.randint(0, 4, (500,), generator=g)
    two = segment_sort(keys, seg)
    one = segment_sort(keys, seg, 50, 4)
    assert torch.equal(two[0], one[0]) and torch.equal(two[1], one[1])


def _n_ids(kjt: Any, last_features: int) -> int:
    """Ids of the last ``last_features`` features of a KJT."""
    return int(kjt.lengths()[-last_features * kjt.stride() :].sum())


# ---------------------------------------------------------------------------------------------
# Multi-process: bit-identical to TorchRec's KJTAllToAll, and through the sharder.


def _same_kjt(a: Any, b: Any) -> bool:
    wa, wb = a.weights_or_none(), b.weights_or_none()
    return (
        a.keys() == b.keys()
        and a.stride() == b.stride()
        and a.stride_per_key_per_rank() == b.stride_per_key_per_rank()
        and torch.equal(a.lengths(), b.lengths())
        and torch.equal(a.values(), b.values())
        and torch.equal(a.offsets(), b.offsets())
        and (
            (wa is None and wb is None)
            or (wa is not None and wb is not None and torch.equal(wa, wb))
        )
        and a.lengths().dtype == b.lengths().dtype
        and a.values().dtype == b.values().dtype
    )


def _worker_a2a(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torchrec.distributed.dist_data import KJTAllToAll

    from torchrec_lossy.distributed import LossyKJTAllToAll
    from torchrec_lossy.distributed.context import DistributedKJT

    pg = dist.group.WORLD
    splits = [2, 3] if world_size == 2 else [2, 0, 3]
    batch = 4 + 3 * rank  # a different batch size on every rank
    ref = KJTAllToAll(pg, splits)
    out: dict[str, Any] = {}
    for case in ("single_hot", "multi_hot", "weighted", "empty", "last_row", "wide", "skewed"):
        kjt = _kjt(case, batch, seed=10 * rank + len(case))
        expected = ref(kjt).wait().wait()
        for dedupe in (True, False):
            comms = _comms(dedupe=dedupe)
            awaitable = LossyKJTAllToAll(pg, splits, comms)(kjt).wait()
            got = awaitable.wait()
            out[(case, dedupe)] = _same_kjt(got, expected)
            # The batch size of every source rides on the KJT, for the output dist.
            assert isinstance(got, DistributedKJT) and got.dist_state is not None
            out[(case, dedupe, "strides")] = got.dist_state.batch_size_per_rank
    out["batch"] = batch
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_kjt_all_to_all_bit_identical_to_torchrec(world_size: int) -> None:
    results = run_workers(_worker_a2a, world_size)
    batches = [r.pop("batch") for r in results]
    for rank, r in enumerate(results):
        for key, value in r.items():
            if key[-1] == "strides":
                assert value == batches, (rank, key)
            else:
                assert value, (rank, key)


def _worker_vbe_a2a(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torchrec.distributed.dist_data import KJTAllToAll

    from torchrec_lossy.distributed import LossyKJTAllToAll

    pg = dist.group.WORLD
    splits = [2, 3] if world_size == 2 else [2, 0, 3]
    ref = KJTAllToAll(pg, splits)
    out: dict[Any, Any] = {}
    for weighted in (False, True):
        kjt = _vbe_kjt(10 * rank + weighted, weighted=weighted)
        expected = ref(kjt).wait().wait()
        for dedupe in (True, False):
            comms = _comms(dedupe=dedupe)
            got = LossyKJTAllToAll(pg, splits, comms)(kjt).wait().wait()
            out[(weighted, dedupe)] = (
                _same_kjt(got, expected)
                and got.variable_stride_per_key()
                and got.stride_per_key() == expected.stride_per_key()
            )
            total = comms.stats.total("input")
            out[(weighted, dedupe, "smaller")] = total.wire_bytes < total.raw_bytes
    return out


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_vbe_kjt_all_to_all_bit_identical_to_torchrec(world_size: int) -> None:
    for rank, r in enumerate(run_workers(_worker_vbe_a2a, world_size)):
        for key, value in r.items():
            assert value, (rank, key)


def _worker_input_faults(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torchrec.distributed.dist_data import KJTAllToAll

    from torchrec_lossy.distributed import LossyKJTAllToAll

    pg = dist.group.WORLD
    splits = [2, 3]
    kjt = _kjt("weighted", 5 + rank, seed=rank)
    expected = KJTAllToAll(pg, splits)(kjt).wait().wait()
    comms = _comms()
    a2a = LossyKJTAllToAll(pg, splits, comms)
    seen: list[tuple[str, int]] = []
    out: dict[str, Any] = {}

    def corrupt(how: str) -> Any:
        def hook(direction: str, source: int, payload: torch.Tensor) -> torch.Tensor:
            seen.append((direction, source))
            if rank != 1 or source != 0:
                return payload
            if how == "truncate":
                return payload[:-1]
            payload = payload.clone()
            payload[0] ^= 1 << 3
            return payload

        return hook

    for how in ("flip", "truncate"):
        comms.payload_hook = corrupt(how)
        try:
            out[how] = "ok" if _same_kjt(a2a(kjt).wait().wait(), expected) else "wrong"
        except LossyAllToAllError as e:
            out[how] = str(e)
    comms.payload_hook = None
    out["recovered"] = _same_kjt(a2a(kjt).wait().wait(), expected)
    out["seen"] = sorted(set(seen))
    return out


@pytest.mark.slow
@pytest.mark.dist
def test_corrupt_input_payload_fails_on_its_receiver_with_the_hook() -> None:
    r0, r1 = run_workers(_worker_input_faults, 2)
    assert r0["flip"] == r0["truncate"] == "ok"  # the sender side is unaffected
    assert "KJT payload from rank 0" in r1["flip"] and "checksum" in r1["flip"], r1["flip"]
    assert "on rank 1" in r1["truncate"] and "words received" in r1["truncate"], r1["truncate"]
    for r in (r0, r1):
        assert r["recovered"]
        assert r["seen"] == [("input", 0), ("input", 1)], r["seen"]


def _worker_sharder(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from torchrec_lossy.config import ErrorBound
    from torchrec_lossy.distributed import LossyEmbeddingBagCollectionSharder

    words_sent: list[int] = []
    a2a = dist.all_to_all_single

    def counting_a2a(output: torch.Tensor, input: torch.Tensor, *args: Any, **kw: Any) -> Any:
        if input.dtype == torch.int32:  # only the packed KJT payloads travel as int32
            words_sent.append(input.numel())
        return a2a(output, input, *args, **kw)

    dist.all_to_all_single = counting_a2a  # type: ignore[assignment]

    tables = make_tables(SHARDER_TABLES)
    exact, lossy = ErrorBound("absolute", 0.0), ErrorBound("relative", 0.03)
    variants: dict[str, Any] = {
        "torchrec": EmbeddingBagCollectionSharder(),
        "off": LossyEmbeddingBagCollectionSharder(
            comms_config=LossyCommsConfig(
                default_bound=exact, input_dist=InputDistConfig(enabled=False), **EXACT_BACKWARD
            )
        ),
        "dedupe": LossyEmbeddingBagCollectionSharder(
            comms_config=LossyCommsConfig(default_bound=exact, **EXACT_BACKWARD)
        ),
        "plain": LossyEmbeddingBagCollectionSharder(
            comms_config=LossyCommsConfig(
                default_bound=exact, input_dist=InputDistConfig(dedupe=False), **EXACT_BACKWARD
            )
        ),
        "lossy_off": LossyEmbeddingBagCollectionSharder(
            comms_config=LossyCommsConfig(
                default_bound=lossy, input_dist=InputDistConfig(enabled=False), **EXACT_BACKWARD
            )
        ),
        # The output dedupe changes the codec's blocks (test_dedupe.py): off here, to show that
        # the packed, deduplicated KJT alone changes nothing downstream.
        "lossy_dedupe": LossyEmbeddingBagCollectionSharder(
            comms_config=LossyCommsConfig(
                default_bound=lossy,
                input_dist=InputDistConfig(dedupe_outputs=False),
                **EXACT_BACKWARD,
            )
        ),
    }
    batches = [
        make_batch(tables, 6 + rank, seed=rank),
        skewed_batch(tables, 32 + 8 * rank, seed=50 + rank),
        make_batch(tables, 5, seed=90 + rank, empty_features=["f3"]),
    ]
    outs: dict[str, list[torch.Tensor]] = {}
    weights: dict[str, dict[str, Any]] = {}
    input_bytes: dict[str, list[int]] = {}
    consistent = True
    for name, sharder in variants.items():
        ebc = make_ebc(tables, seed=0)
        plan = manual_plan(ebc, sharder, sharder_plan(), world_size)
        model = DistributedModelParallel(
            ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder]
        )
        load_full_weights(model.state_dict(), ebc.state_dict())  # TorchRec re-inits CPU shards
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        outs[name] = []
        input_bytes[name] = []
        for step, kjt in enumerate(batches):
            words_sent.clear()
            stats = getattr(model.module, "lossy_stats", None)
            if stats is not None:
                stats.reset()
            outs[name].append(train_step(model, opt, kjt, step, rank))
            if stats is not None:
                total = stats.total("input")
                input_bytes[name].append(total.wire_bytes)
                # Telemetry equals the packed words handed to the payload all-to-all.
                meta = stats.table(SPLITS, "input").wire_bytes
                consistent &= 4 * sum(words_sent) == total.wire_bytes - meta
        weights[name] = {k: v.clone() for k, v in _local_state(model).items()}
    ref = "torchrec"
    return {
        "out_equal": {
            n: all(torch.equal(a, b) for a, b in zip(outs[n], outs[ref], strict=True))
            for n in ("off", "dedupe", "plain")
        },
        "w_equal": {n: _same_state(weights[n], weights[ref]) for n in ("off", "dedupe", "plain")},
        "lossy_out_equal": all(
            torch.equal(a, b) for a, b in zip(outs["lossy_dedupe"], outs["lossy_off"], strict=True)
        ),
        "lossy_w_equal": _same_state(weights["lossy_dedupe"], weights["lossy_off"]),
        "input_bytes": input_bytes,
        "consistent": consistent,
    }


def _local_state(model: Any) -> dict[str, torch.Tensor]:
    return {
        f"{k}@{o}": t for k, pieces in local_weights(model.state_dict()).items() for o, t in pieces
    }


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.dist
def test_sharder_exact_with_and_without_dedupe_and_fewer_bytes_on_skew() -> None:
    results = run_workers(_worker_sharder, 2, timeout_s=600)  # ~45 s alone; 300 s under load
    for rank, r in enumerate(results):
        # Bound 0: outputs and trained weights bit-identical to TorchRec's sharder.
        assert all(r["out_equal"].values()), (rank, r["out_equal"])
        assert all(r["w_equal"].values()), (rank, r["w_equal"])
        # Bound > 0: the packed (deduplicated) input dist changes nothing downstream.
        assert r["lossy_out_equal"] and r["lossy_w_equal"], rank
        assert r["consistent"], rank
        on, off = r["input_bytes"]["dedupe"], r["input_bytes"]["plain"]
        assert on[1] < off[1], (rank, on, off)  # the skewed step
        assert on[0] <= off[0] and on[2] <= off[2], (rank, on, off)


def test_recat_adapter_pins_torchrec() -> None:
    """``torchrec_recat`` is the one adapter to TorchRec's private ``_get_recat``: this fails
    when TorchRec renames it, changes its parameters, stops building its awaitable's recat with
    it, or changes its values."""
    assert "_get_recat(" in inspect.getsource(KJTAllToAllTensorsAwaitable.__init__)
    params = list(inspect.signature(_get_recat).parameters)
    assert params == ["local_split", "num_splits", "stagger", "device", "batch_size_per_rank"]
    cpu = torch.device("cpu")
    assert torchrec_recat([2, 2, 2], 0, cpu, [2, 2, 2]).tolist() == [0, 2, 4, 1, 3, 5]
    got = torchrec_recat([2, 2, 2], 1, cpu, [1, 2, 3]).tolist()
    assert got == [0, 2, 3, 6, 7, 8, 1, 4, 5, 9, 10, 11]
