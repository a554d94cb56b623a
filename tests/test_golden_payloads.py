"""Today's code writes the checked-in golden payloads byte for byte and decodes them unchanged.

The corpus (``tests/golden/corpus.py``) guards refactors of the codec and the KJT codec: every
backend must reproduce it. A failure here means the wire format changed: regenerate the corpus
only when that is the intent.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
import corpus

from torchrec_lossy.codec import compress

STORED = corpus.load()
PRODUCERS = corpus.producers()


def test_corpus_covers_every_producer() -> None:
    assert set(PRODUCERS) <= set(STORED)
    assert len(PRODUCERS) == 82


@pytest.mark.parametrize("name", sorted(PRODUCERS))
def test_writes_the_golden_bytes(name: str) -> None:
    assert PRODUCERS[name]() == STORED[name]


@pytest.mark.parametrize("name", sorted(corpus.CODEC_CONFIGS))
def test_decodes_the_golden_payloads_unchanged(name: str) -> None:
    assert corpus.decoded_digest(STORED[f"codec/{name}"]) == STORED[f"digest/{name}"].decode()


@pytest.mark.parametrize("name", [*(f"codec/{n}" for n in corpus.PACKED_CONFIGS), "value/default"])
def test_decodes_the_packed_golden_payloads_unchanged(name: str) -> None:
    stored = STORED[f"packed/{name}"]
    assert corpus.decoded_digest(stored) == STORED[f"digest/packed/{name}"].decode()


@pytest.mark.parametrize("name", ["default", "stochastic"])
def test_reference_backend_writes_the_golden_bytes(name: str) -> None:
    config = dataclasses.replace(corpus.CODEC_CONFIGS[name], backend="reference")
    assert compress(*corpus.codec_blocks(), config).numpy().tobytes() == STORED[f"codec/{name}"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["default", "stochastic"])
def test_device_backend_writes_the_golden_bytes(name: str) -> None:
    pytest.importorskip("triton")
    config = dataclasses.replace(corpus.CODEC_CONFIGS[name], backend="triton")
    payload = compress(*corpus.codec_blocks(), config)
    assert payload.cpu().numpy().tobytes() == STORED[f"codec/{name}"]


@pytest.mark.parametrize("name", sorted(corpus.VALUE_CONFIGS))
def test_value_mode_entries_decode_and_the_reference_writes_them(name: str) -> None:
    stored = STORED[f"value/{name}"]
    assert corpus.decoded_digest(stored) == STORED[f"digest/value/{name}"].decode()
    config = dataclasses.replace(corpus.VALUE_CONFIGS[name], backend="reference")
    assert corpus.value_payload(config) == stored


@pytest.mark.slow
def test_device_backend_writes_the_value_mode_golden_bytes() -> None:
    pytest.importorskip("triton")
    config = dataclasses.replace(corpus.VALUE_CONFIGS["default"], backend="triton")
    assert corpus.value_payload(config) == STORED["value/default"]


def test_kjt_backends_agree_in_the_corpus() -> None:
    torch_entries = [k for k in STORED if k.startswith("kjt/") and k.endswith("/torch")]
    assert torch_entries
    for k in torch_entries:
        assert STORED[k] == STORED[k.removesuffix("torch") + "numba"], k
