"""A row's exposure trace, compact: int32 little-endian lengths then ids, xz, base64; it decodes to the same trace."""

from __future__ import annotations

import base64
import hashlib
import lzma

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge_sdk.privacy.meter import ExposureTrace
from eval_harness.sweep.exposure_codec import CODEC, decode_trace, encode_trace


def test_the_encoding_is_int32_lengths_then_ids_in_xz_in_base64() -> None:
    trace = ExposureTrace(3, ((5, 1, 262143), (7,), ()))
    encoded = encode_trace(trace)
    assert (encoded["codec"], encoded["k"], encoded["steps"]) == (CODEC, 3, 3)
    raw = lzma.decompress(base64.b64decode(encoded["ids"]))
    # by hand: three lengths (3, 1, 0), then 5, 1, 262143 = 0x3ffff and 7, each 4 bytes little-endian
    expected = bytes([3, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 1, 0, 0, 0, 0xFF, 0xFF, 0x03, 0x00, 7, 0, 0, 0])
    assert raw == expected and encoded["sha256"] == hashlib.sha256(expected).hexdigest()
    assert decode_trace(encoded) == trace


def test_an_edited_trace_is_refused_by_its_digest_and_an_older_row_without_one_still_decodes() -> None:
    encoded = encode_trace(ExposureTrace(3, ((5, 1, 9), (7,))))
    # swap the first step's last two ids: the same set, so a set-based metric would not see it
    edited = encode_trace(ExposureTrace(3, ((5, 9, 1), (7,))))
    with pytest.raises(ValueError, match="does not match its sha256"):
        decode_trace({**edited, "sha256": encoded["sha256"]})
    older = {name: value for name, value in encoded.items() if name != "sha256"}
    assert decode_trace(older) == ExposureTrace(3, ((5, 1, 9), (7,)))


traces = st.integers(1, 40).flatmap(lambda k: st.builds(
    ExposureTrace, st.just(k),
    st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=k, unique=True).map(tuple), max_size=12).map(tuple)))


@pytest.mark.slow
@given(traces)
def test_every_trace_decodes_to_itself(trace: ExposureTrace) -> None:
    assert decode_trace(encode_trace(trace)) == trace


def test_a_damaged_or_foreign_trace_is_refused() -> None:
    encoded = encode_trace(ExposureTrace(2, ((4, 2), (9,))))
    with pytest.raises(ValueError, match="codec 'json'"):
        decode_trace({**encoded, "codec": "json"})
    with pytest.raises(ValueError, match="damaged"):
        decode_trace({**encoded, "ids": encoded["ids"][:-8]})
    with pytest.raises(ValueError, match="do not hold 3 steps"):
        decode_trace({**encoded, "steps": 3})
    with pytest.raises(ValueError, match="more than the trace's k=1"):
        decode_trace({**encoded, "k": 1})
