"""The packed decode's torch twins (``kernels/packed_ref.py``, ``quantize_ref.
decode_packed_outputs``) against their Triton launchers: every call the device decode of a packed
payload makes, replayed on the twin, gives the same result bit for bit and leaves the status rows
it is given the same; on corrupt payloads too (every launcher but the output kernel, whose
output is unspecified where a block fails)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the launchers cannot run")

from helpers import INTERPRETER_WARNINGS, as_tensor, parse, with_checksum
from kernel_calls import Call, assert_same, recorded_calls, replay

from torchrec_lossy.codec import CodecConfig, CodecError, compress, compress_groups, decompress
from torchrec_lossy.codec.device_decompress import _layout
from torchrec_lossy.codec.grouped import decompress_groups
from torchrec_lossy.kernels import packed, packed_ref, quantize, quantize_ref

pytestmark = INTERPRETER_WARNINGS

PACKED = CodecConfig(format="packed")
CHECKS = ("packed_checksums", "packed_widths", "check_groups", "packed_status")


def _decode_calls(
    monkeypatch: pytest.MonkeyPatch, run: Callable[[], object]
) -> tuple[list[Call], str]:
    """The packed launchers' calls (then the output kernel's) made by ``run``, and the error
    it raised ("" for none)."""
    error = ""
    with (
        recorded_calls(monkeypatch, packed, CHECKS) as p_calls,
        recorded_calls(monkeypatch, quantize, ["decode_packed_outputs"]) as q_calls,
    ):
        try:
            run()
        except CodecError as e:  # the corrupt cases
            error = str(e)
    return p_calls + q_calls, error


def _assert_twins(calls: list[Call], outputs: bool = True) -> None:
    names = {c.name for c in calls}
    assert set(CHECKS) <= names, names
    for k, call in enumerate(calls):
        if call.name == "decode_packed_outputs" and not outputs:
            continue
        twin = getattr(quantize_ref if call.name == "decode_packed_outputs" else packed_ref,
                       call.name)  # fmt: skip
        result, args, kwargs = replay(call, twin)
        assert_same(result, call.result, f"call {k} {call.name} result")
        assert_same(args, call.args_after, f"call {k} {call.name} args")
        assert_same(kwargs, call.kwargs_after, f"call {k} {call.name} kwargs")


def _blocks() -> tuple[list[torch.Tensor], list[float]]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(48, 40, generator=g)
    x[4], x[9] = x[2], x[2]
    x[3, 1], x[5, 7], x[11] = math.nan, -math.inf, 3e38
    half = torch.randn(20, 6, generator=g).bfloat16()
    return [x, torch.zeros(3, 8), half, torch.randn(2, 3, generator=g)], [0.02, 0.1, 0.01, 0.0]


def test_twins_agree_on_a_valid_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks, bounds = _blocks()
    payload = compress(blocks, bounds, PACKED)
    calls, error = _decode_calls(monkeypatch, lambda: decompress(payload, backend="triton"))
    assert not error
    _assert_twins(calls)
    grouped = compress_groups([blocks[:2], blocks[2:]], [bounds[:2], bounds[2:]], PACKED)
    calls, _ = _decode_calls(monkeypatch, lambda: decompress_groups(
        grouped.buffer, grouped.sizes, backend="triton", skeletons=grouped.skeletons))  # fmt: skip
    _assert_twins(calls)


@pytest.mark.parametrize("edit", ["code", "width", "escapes"])
def test_twins_agree_on_a_corrupt_payload(monkeypatch: pytest.MonkeyPatch, edit: str) -> None:
    blocks, bounds = _blocks()
    buf = bytearray(compress(blocks, bounds, PACKED).numpy().tobytes())
    lay = _layout(np.frombuffer(bytes(buf), np.uint8), 1 << 28)
    _, _, segs = parse(bytes(buf))
    at, n = segs[0]
    if edit == "code":
        buf[at + n - 4] ^= 0xFF
    elif edit == "width":
        buf[4 * int(lay.ct_off[0])] = 200  # block 0's first group's width, past the cap
    else:
        pos = 4 * int(lay.esc_pos_off[0])  # block 0's first listed escape, past its values
        buf[pos : pos + 4] = np.uint32(10**6).tobytes()
    payload = as_tensor(with_checksum(buf))
    calls, error = _decode_calls(monkeypatch, lambda: decompress(payload, backend="triton"))
    assert "block 0: packed codes" in error, error
    _assert_twins(calls, outputs=False)
