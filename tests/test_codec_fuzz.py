"""Malformed payloads: decompress raises CodecError (with a message) and nothing else.

Two layers:

- Blind corruption (bit flips, truncation, appended and random bytes, wrong magic / version) is
  caught by the header checks and the checksum.
- Body mutations followed by a RECOMPUTED checksum reach the parser's own validation
  (descriptors, segment headers, codebook, references, escapes, chunk table, bitstream). Those
  payloads must raise CodecError or decode to tensors of the shapes and dtypes their descriptors
  declare; a structurally valid payload may decode to wrong values.

The corpus covers the four block modes, both reference packings, escapes and multi-chunk Huffman
streams. The same campaign also runs in a subprocess with numba bounds checking on
(``NUMBA_BOUNDSCHECK=1``), where an out-of-bounds access inside a kernel becomes an IndexError
instead of silent garbage or a segfault.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    INTERESTING_U32,
    apply_mutation,
    as_tensor,
    corpus,
    field_positions,
    interesting_values,
    parse,
    set_field,
    with_checksum,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchrec_lossy.codec import CodecError, decompress
from torchrec_lossy.codec.format import (
    CODE_DTYPES,
    DESCRIPTOR,
    HEADER,
    MAGIC,
    MODE_RAW,
    SEGMENT_HEADER,
    VERSION,
)
from torchrec_lossy.codec.pipeline import decompress_host_groups

FUZZ_MAX_ELEMENTS = 1 << 22  # keeps a mutated rows/dim field from asking for gigabytes
HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# ---------------------------------------------------------------------------------------------
# Corpus


def test_corpus_covers_every_mode_and_packing():
    modes, packings, escapes, chunks = set(), set(), 0, 0
    for _, buf in corpus():
        _, descs, segs = parse(buf)
        for d, (off, _) in zip(descs, segs, strict=True):
            modes.add(int(d["mode"]))
            if int(d["mode"]) != MODE_RAW:
                sh = np.frombuffer(buf[off : off + 32], SEGMENT_HEADER)[0]
                if int(d["mode"]) & 1:
                    packings.add(int(sh["ref_mode"]))
                if int(d["mode"]) & 2:
                    escapes = max(escapes, int(sh["n_escapes"]))
                    chunks = max(chunks, int(sh["n_chunks"]))
    assert modes == {0, 1, 2, 3}
    assert packings == {0, 1}
    assert escapes >= 3 and chunks >= 5


# ---------------------------------------------------------------------------------------------
# Helpers


def declared(buf: bytes) -> list[tuple[tuple[int, int], torch.dtype]]:
    header = np.frombuffer(buf[:32], HEADER)[0]
    n = int(header["n_blocks"])
    descs = np.frombuffer(buf[32 : 32 + 24 * n], DESCRIPTOR)
    return [((int(d["rows"]), int(d["dim"])), CODE_DTYPES[int(d["dtype"])]) for d in descs]


def decode_or_error(buf: bytes) -> str | None:
    """None if the payload decodes to its declared blocks, else the CodecError's message.

    Any other exception propagates (and fails the test).
    """
    try:
        out = decompress(as_tensor(buf), FUZZ_MAX_ELEMENTS)
    except CodecError as e:
        assert str(e), "CodecError without a message"
        return str(e)
    want = declared(buf)
    assert len(out) == len(want)
    for t, (shape, dtype) in zip(out, want, strict=True):
        assert tuple(t.shape) == shape and t.dtype == dtype
    return None


def expect_error(buf: bytes) -> str:
    msg = decode_or_error(buf)
    assert msg is not None, "a corrupted payload decoded"
    return msg


# ---------------------------------------------------------------------------------------------
# Blind corruption: always caught


def test_corpus_decodes():
    for _, buf in corpus():
        assert decode_or_error(buf) is None


def test_every_truncation_is_rejected():
    n_cases = 0
    for _, buf in corpus():
        for n in range(len(buf)):
            msg = expect_error(buf[:n])
            assert "truncated" in msg, msg
            n_cases += 1
    assert n_cases > 2000


def test_truncated_then_rechecksummed_is_rejected():
    """Trailing words dropped, body_words and checksum fixed: the segment sizes do not add up."""
    for _, buf in corpus():
        _, descs, _ = parse(buf)
        for n in range(32 + 24 * len(descs), len(buf), 4):
            msg = expect_error(with_checksum(buf[:n]))
            assert "checksum" not in msg


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10), st.binary(min_size=1, max_size=64))
def test_appended_bytes_are_rejected(k, extra):
    buf = corpus()[k][1]
    msg = expect_error(buf + extra)
    assert "padded" in msg or "truncated" in msg


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10), st.data())
def test_single_bit_flips_in_the_body_are_caught(k, data):
    buf = bytearray(corpus()[k][1])
    bit = data.draw(st.integers(32 * 8, 8 * len(buf) - 1))
    buf[bit // 8] ^= 1 << (bit % 8)
    assert "checksum" in expect_error(bytes(buf))


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10), st.data())
def test_random_bit_flips_anywhere(k, data):
    buf = bytearray(corpus()[k][1])
    bits = data.draw(st.lists(st.integers(0, 8 * len(buf) - 1), min_size=1, max_size=8))
    for bit in bits:
        buf[bit // 8] ^= 1 << (bit % 8)
    decode_or_error(bytes(buf))  # header flags / reserved flips may decode; nothing may crash


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_random_bytes_are_rejected(buf):
    expect_error(buf)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 40).flatmap(lambda n: st.binary(min_size=4 * n, max_size=4 * n)))
def test_random_body_under_a_valid_header(body):
    header = np.zeros(1, HEADER)
    header["magic"], header["version"] = MAGIC, VERSION
    header["n_blocks"] = len(body) // 24 if body else 0
    buf = with_checksum(header.tobytes() + body)
    decode_or_error(buf)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, 10),
    st.integers(0, 7),
    st.integers(0, 2**32 - 1),
    st.data(),
)
def test_random_descriptor_count_under_a_valid_checksum(k, which, n_blocks, data):
    buf = bytearray(corpus()[k][1])
    header = np.frombuffer(bytes(buf[:32]), HEADER).copy()
    header["n_blocks"] = [0, 1, 2, 3, 5, 2**31, 2**32 - 1, n_blocks][which]
    buf[:32] = header.tobytes()
    decode_or_error(with_checksum(buf))


@pytest.mark.parametrize("magic", [0, MAGIC ^ 1, MAGIC ^ 0x80000000, 0x54524C43, 2**32 - 1])
def test_wrong_magic(magic):
    buf = bytearray(corpus()[0][1])
    buf[0:4] = int(magic).to_bytes(4, "little")
    assert "not a torchrec-lossy payload" in expect_error(bytes(buf))


@pytest.mark.parametrize("version", [0, VERSION + 1, 0xFFFF, 0x100])
def test_wrong_version(version):
    buf = bytearray(corpus()[0][1])
    buf[4:6] = int(version).to_bytes(2, "little")
    assert "version" in expect_error(bytes(buf))


def test_header_shorter_than_32_bytes():
    for n in range(32):
        assert "truncated" in expect_error(corpus()[0][1][:n])


def test_body_words_lies():
    buf = corpus()[0][1]
    for words in (0, 1, (len(buf) - 32) // 4 - 1, (len(buf) - 32) // 4 + 1, 2**63, 2**64 - 1):
        b = bytearray(buf)
        header = np.frombuffer(bytes(b[:32]), HEADER).copy()
        header["body_words"] = words
        b[:32] = header.tobytes()
        expect_error(bytes(b))


# ---------------------------------------------------------------------------------------------
# Structural mutation under a valid checksum: the parser's own validation


def _normalise(msg: str) -> str:
    return re.sub(r"-?\d[\d.e+-]*", "#", msg)


def test_every_header_field_set_to_edge_values():
    """Deterministic sweep: each structured field of each corpus payload, edge values."""
    messages: dict[str, int] = {}
    n_cases = n_decoded = 0
    for _, buf in corpus():
        for off, _name, dt in field_positions(buf):
            current = np.frombuffer(buf[off : off + dt.itemsize], dt)[0]
            for v in interesting_values(dt, current):
                mutated = with_checksum(set_field(buf, off, dt, v))
                msg = decode_or_error(mutated)
                n_cases += 1
                if msg is None:
                    n_decoded += 1
                else:
                    assert "checksum" not in msg
                    key = _normalise(msg)
                    messages[key] = messages.get(key, 0) + 1
    assert n_cases > 3000
    # The sweep reaches many distinct validations, not just one early check.
    assert len(messages) >= 12, sorted(messages)
    assert n_decoded > 0  # e.g. the informative bound field, or a reserved byte


_MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 2**31), st.integers(0, 7)),
    st.tuples(st.just("byte"), st.integers(0, 2**31), st.integers(0, 255)),
    st.tuples(st.just("word"), st.integers(0, 2**31), st.sampled_from(INTERESTING_U32)),
    st.tuples(st.just("delete"), st.integers(0, 2**31), st.integers(1, 8)),
    st.tuples(st.just("insert"), st.integers(0, 2**31), st.integers(1, 8)),
    st.tuples(st.just("swap"), st.integers(0, 2**31), st.integers(0, 2**31)),
    st.tuples(st.just("zero_tail"), st.integers(0, 2**31), st.just(0)),
)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10), st.lists(_MUTATION, min_size=1, max_size=4))
def test_body_mutations_with_a_valid_checksum(k, mutations):
    buf = corpus()[k][1]
    for m in mutations:
        buf = apply_mutation(buf, m)
    msg = decode_or_error(with_checksum(buf))
    assert msg is None or "checksum" not in msg


# ---------------------------------------------------------------------------------------------
# Exact messages: the first check a block fails names the error, whichever decoder runs


def _segment_fields(buf: bytes, block: int, **fields: float) -> bytes:
    """``buf`` with segment header fields of block ``block`` set, checksum recomputed."""
    offset = parse(buf)[2][block][0]
    for name, v in fields.items():
        dt, off = SEGMENT_HEADER.fields[name][:2]
        buf = set_field(buf, offset + off, dt, v)
    return with_checksum(buf)


def _descriptor_field(buf: bytes, block: int, name: str, v: int) -> bytes:
    dt, off = DESCRIPTOR.fields[name][:2]
    return with_checksum(set_field(buf, 32 + 24 * block + off, dt, v))


def _exact_cases() -> dict[str, tuple[bytes, str]]:
    c = dict(corpus())
    two = _segment_fields(c["multi"], 1, n_unique=0)  # blocks 1 and 3 both corrupt
    two = _segment_fields(two, 3, ref_mode=7)
    # Each case fails a later check too (the one named is the first in wire order).
    cases = {
        "escapes before chunks": (
            _segment_fields(c["quant"], 0, n_escapes=10**6, n_chunks=0),
            "1000000 escapes for 576 elements",
        ),
        "codebook before chunks": (
            _segment_fields(c["quant"], 0, n_chunks=0, sym_lo=4095),
            "codebook range 4095+165 / escape length 0 out of range",
        ),
        "grid before codebook": (
            _segment_fields(c["quant"], 0, step=math.nan, sym_lo=4095),
            "quantization step nan / center 6 out of range",
        ),
        "center": (
            _segment_fields(c["quant"], 0, center=2**24),
            "quantization step 0.03999999910593033 / center 16777216 out of range",
        ),
        "per-value grid": (
            _descriptor_field(_segment_fields(c["quant"], 0, step=2.0), 0, "mode", 6),
            "per-value grid step 2.0 / largest code 6 out of range",
        ),
        "vectors before escapes": (
            _segment_fields(c["quant"], 0, n_unique=5, n_escapes=10**6),
            "5 vectors for 48 rows",
        ),
        "chunk size": (
            _segment_fields(c["quant"], 0, chunk_symbols=0),
            "9 chunks of 0 symbols for 576 symbols",
        ),
        "escape positions truncated": (
            _segment_fields(c["quant"], 0, n_escapes=200),
            "escape positions needs 200 words at word 29 of a 157-word segment",
        ),
        "references before escapes": (
            _segment_fields(c["quant_lz_fixed"], 0, ref_width=9, n_escapes=10**6),
            "4 distinct vectors with 9-bit ids for 60 rows",
        ),
        "packing before chunks": (
            _segment_fields(c["quant_lz_flagged"], 0, ref_mode=2, n_chunks=1),
            "unknown reference packing 2",
        ),
        "references out of range": (
            _segment_fields(c["lz_fixed"], 0, n_unique=3),
            "vector references out of range",
        ),
        "trailing": (
            _segment_fields(c["lz_fixed"], 0, n_unique=1, ref_width=0),
            "18 trailing words",
        ),
        "raw truncated": (
            _descriptor_field(c["multi"], 2, "dim", 6),
            "raw values needs 36 words at word 0 of a 30-word segment",
        ),
        "segment header truncated": (
            _descriptor_field(c["degenerate"], 2, "mode", 2),
            "segment header needs 8 words at word 0 of a 1-word segment",
        ),
        "first block wins": (two, "0 distinct vectors with 2-bit ids for 30 rows"),
    }
    block = {"raw truncated": 2, "segment header truncated": 2, "first block wins": 1}
    return {
        k: (buf, f"corrupt payload: block {block.get(k, 0)}: {m}") for k, (buf, m) in cases.items()
    }


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("case", list(_exact_cases()))
def test_segment_errors_are_exact(case, backend):
    buf, message = _exact_cases()[case]
    with pytest.raises(CodecError) as info:
        decompress(as_tensor(buf), backend=backend)
    assert str(info.value) == message


def test_huffman_stream_error_is_the_compiled_decoders():
    """The compiled decoder names the stream's own failure (the reference stages name any
    undecodable pattern an invalid code)."""
    buf = bytearray(dict(corpus())["quant"])
    offset, n = parse(bytes(buf))[2][0]
    buf[offset + n - 4] ^= 0xFF  # the bitstream's last word
    with pytest.raises(CodecError) as info:
        decompress(as_tensor(with_checksum(bytes(buf))))
    assert str(info.value) == "corrupt payload: block 0: Huffman stream: a chunk runs out of bits"


def test_grouped_decode_names_each_payloads_error():
    """Several payloads in one compiled call: each corrupt one gets its own first error, the
    others decode to what they decode to alone."""
    cases = _exact_cases()
    good = [buf for _, buf in corpus()[:3]]
    bad = [cases["first block wins"], cases["raw truncated"], cases["trailing"]]
    bufs = [good[0], bad[0][0], good[1], bad[1][0], bad[2][0], good[2]]
    sizes = [len(b) for b in bufs]
    got = decompress_host_groups(as_tensor(b"".join(bufs)), sizes, 1 << 22)
    for k in (0, 2, 5):
        want = decompress(as_tensor(bufs[k]))
        assert all(torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
                   for a, b in zip(got[k], want, strict=True))  # fmt: skip
    assert [str(got[k]) for k in (1, 3, 4)] == [m for _, m in bad]


# ---------------------------------------------------------------------------------------------
# Crafted payloads


def craft(rows: int, dim: int, mode: int, segment: bytes, dtype_code: int = 1) -> bytes:
    desc = np.zeros(1, DESCRIPTOR)
    desc["rows"], desc["dim"], desc["dtype"], desc["mode"] = rows, dim, dtype_code, mode
    desc["seg_words"] = len(segment) // 4
    header = np.zeros(1, HEADER)
    header["magic"], header["version"], header["n_blocks"] = MAGIC, VERSION, 1
    return with_checksum(header.tobytes() + desc.tobytes() + segment)


def _lz_segment(n_unique: int = 1) -> bytes:
    seg = np.zeros(1, SEGMENT_HEADER)
    seg["n_unique"], seg["ref_mode"], seg["ref_width"] = n_unique, 0, 0
    return seg.tobytes()


def test_crafted_minimal_lz_block_decodes():
    """A hand-made LZ block (one distinct vector, 0-bit references) decodes as the spec says."""
    seg = _lz_segment() + np.array([1.5, -2.0, 0.25], np.float32).tobytes()
    out = decompress(as_tensor(craft(5, 3, 1, seg)))[0]
    assert torch.equal(out, torch.tensor([[1.5, -2.0, 0.25]]).repeat(5, 1))


def test_max_elements_guard_survives_int64_overflow():
    """rows * dim = (2**32-1) * (2**31+1) >= 2**63 must not wrap past the guard."""
    buf = craft(2**32 - 1, 2**31 + 1, MODE_RAW, b"")
    msg = expect_error(buf)
    assert "max_elements" in msg, msg


_ALLOC_SCRIPT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
import numpy as np, torch
from torchrec_lossy.codec import CodecError, decompress
status = 0
for path in sys.argv[1:]:
    buf = torch.from_numpy(np.fromfile(path, np.uint8))
    try:
        decompress(buf, max_elements=1000)
        print(path, "decoded")
        status = 1
    except CodecError as e:
        print(path, "CodecError", e)
    except BaseException as e:
        print(path, type(e).__name__, e)
        status = 1
sys.exit(status)
"""


def test_crafted_lz_payload_cannot_allocate_gigabytes(tmp_path):
    """An 88-byte LZ payload must be refused, not decoded into a 16 GiB id array.

    Two payloads, one distinct vector and 0-bit references each: rows=2**32-1 with
    dim=2**31+1 (rows * dim wraps negative in int64) and with dim=0 (rows * dim = 0 passes the
    guard). In a subprocess under a 6 GiB address-space limit both must raise CodecError (a
    MemoryError from the id array would mean the guard let them through).
    """
    paths = []
    for k, dim in enumerate((2**31 + 1, 0)):
        path = tmp_path / f"payload{k}.bin"
        path.write_bytes(craft(2**32 - 1, dim, 1, _lz_segment()))
        paths.append(str(path))
    proc = subprocess.run(
        [sys.executable, "-c", _ALLOC_SCRIPT, *paths],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# The same campaign with numba bounds checking, in a subprocess


def campaign(seed: int, n_random: int) -> dict[str, int]:
    """Field sweep plus ``n_random`` random mutation chains; raises on any non-CodecError."""
    rng = np.random.default_rng(seed)
    counts = {"cases": 0, "decoded": 0}
    for _, buf in corpus():
        for off, _name, dt in field_positions(buf):
            current = np.frombuffer(buf[off : off + dt.itemsize], dt)[0]
            for v in interesting_values(dt, current):
                counts["decoded"] += (
                    decode_or_error(with_checksum(set_field(buf, off, dt, v))) is None
                )
                counts["cases"] += 1
    kinds = ["flip", "byte", "word", "delete", "insert", "swap", "zero_tail"]
    payloads = corpus()
    for _ in range(n_random):
        buf = payloads[rng.integers(len(payloads))][1]
        for _ in range(rng.integers(1, 4)):
            kind = kinds[rng.integers(len(kinds))]
            a = int(rng.integers(2**31))
            b = {"flip": 8, "byte": 256, "delete": 9, "insert": 9}.get(kind, 2**31)
            b = int(rng.integers(b))
            if kind == "word":
                b = INTERESTING_U32[b % len(INTERESTING_U32)]
            if kind in ("delete", "insert"):
                b = max(b, 1)
            buf = apply_mutation(buf, (kind, a, b))
        counts["decoded"] += decode_or_error(with_checksum(buf)) is None
        counts["cases"] += 1
    return counts


_CAMPAIGN = """
import json, sys
import numpy as np
import numba
try:  # bounds checking is really on: an out-of-bounds read in compiled code raises
    numba.njit(lambda a, i: a[i])(np.zeros(1, np.uint32), 2)
    sys.exit("NUMBA_BOUNDSCHECK had no effect")
except IndexError:
    pass
sys.path.insert(0, sys.argv[1])
import test_codec_fuzz
print(json.dumps(test_codec_fuzz.campaign(int(sys.argv[2]), int(sys.argv[3]))))
"""


@pytest.mark.slow  # about 75 s: a fresh interpreter recompiles the codec with bounds checks
@pytest.mark.timeout(300)
def test_fuzz_campaign_under_numba_boundscheck(request, tmp_path):
    # A separate numba cache: boundschecked machine code must never land in the project's cache
    # (numba's cache key ignores NUMBA_BOUNDSCHECK).
    cache = getattr(request.config, "cache", None)
    cache_dir = cache.mkdir("numba-boundscheck") if cache is not None else tmp_path / "numba"
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(cache_dir))
    proc = subprocess.run(
        [sys.executable, "-c", _CAMPAIGN, str(HERE), "1234", "2000"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["cases"] > 5000
