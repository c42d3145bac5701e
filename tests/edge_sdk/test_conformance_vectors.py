"""The committed golden vectors (tests/conformance/vectors.json) are exactly what the Python SDK writes today.

The TypeScript SDK's tests replay these vectors bit for bit, so a Python change that alters a decision, an upload,
a ledger entry, an epsilon or a ``never_upload`` mask must fail here until the vectors are re-written on purpose
(``python -m tests.conformance.write_vectors``) and the TypeScript side follows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conformance import write_vectors


@pytest.fixture(scope="module")
def fresh() -> str:
    return write_vectors.render(write_vectors.build())


def test_committed_vectors_equal_a_fresh_write(fresh: str) -> None:
    committed = write_vectors.VECTORS.read_text(encoding="utf-8")
    if committed != fresh:
        old, new = json.loads(committed), json.loads(fresh)
        changed = [a["name"] for a, b in zip(old["cases"], new["cases"]) if a != b]
        pytest.fail(f"tests/conformance/vectors.json is stale ({len(changed)} cases differ, first: {changed[:3]}; "
                    f"masking {'differs' if old['masking'] != new['masking'] else 'agrees'}): re-write it with "
                    "`python -m tests.conformance.write_vectors` if the change is meant")


def test_vectors_cover_every_policy_mode_and_space(fresh: str) -> None:
    from edge_sdk.policies import POLICIES

    cases = json.loads(fresh)["cases"]
    covered = {(case["policy"], case["mode"], case["space"]) for case in cases}
    wanted = {(name, mode, space) for name in POLICIES.names() for mode in POLICIES.get(name).modes
              for space in (("prob", "logit") if name in write_vectors.SPACED else ("prob",))}
    assert covered == wanted
    steps = [step["expect"] for case in cases for step in case["steps"]]
    # every kind of step the replay must reproduce occurs: withheld, full row asked for, steered, released
    for flag in ("withheld", "full_requested", "steered", "released"):
        assert any(step[flag] for step in steps) and not all(step[flag] for step in steps), flag
    assert any(case["masked_ids"] for case in cases) and any(case["vocab_size"] > 1000 for case in cases)
    # edge-side every token carries its log-probabilities (the fused row's), cloud-side the cloud sends them
    assert all(("logprobs" in step["expect"]) == (case["mode"] == "edge") for case in cases for step in case["steps"])


def test_recorded_draws_replay_the_generator() -> None:
    """The recorded stream holds the very numbers numpy's generator hands out, in order (checked against a fresh
    generator of the same seed, not against the recorder)."""
    draws = write_vectors.RecordedDraws(7)
    first, raw, second = draws.random(), draws.bit_generator.random_raw(3), draws.random()
    reference = np.random.default_rng(7)
    assert first == reference.random()
    assert [int(x) for x in raw] == [int(x) for x in reference.bit_generator.random_raw(3)]
    assert second == reference.random()
    assert draws.take() == [["random", write_vectors.f64_hex(first)],
                            ["raw", [f"{int(x):016x}" for x in raw]], ["random", write_vectors.f64_hex(second)]]
    with pytest.raises(TypeError):
        draws.random(3)


def test_float_encodings_round_trip_bit_for_bit() -> None:
    values = np.array([0.0, -0.0, 1.5, np.finfo(np.float32).min, np.float32(1e-45), np.inf], dtype=np.float32)
    assert write_vectors.f32_hex(values[:3]) == "00000000" + "00000080" + "0000c03f"  # little-endian, by hand
    assert write_vectors.f64_hex(1.0) == "3ff0000000000000" and write_vectors.f64_hex(np.inf) == "7ff0000000000000"
    decoded = np.frombuffer(bytes.fromhex(write_vectors.f32_hex(values)), dtype="<f4")
    assert decoded.tobytes() == values.tobytes()
