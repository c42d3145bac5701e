"""``decodeleak compare-quant``: the per-step comparison against hand-worked numbers, teacher forcing, the
quantiser and its cache, and a tiny end-to-end run writing the table and the figure."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from edge_sdk.policies import CoVeil
from eval_harness.compare.drift import StepReference, kl_divergence, top_k_overlap

LN2 = math.log(2.0)


def logits(*p: float) -> np.ndarray:
    return np.log(np.asarray(p, dtype=np.float64)).astype(np.float32)


# -- KL and top-K overlap -----------------------------------------------------------------------------------


def test_kl_divergence_matches_hand_worked_values_in_both_directions() -> None:
    p, q = logits(0.8, 0.1, 0.1), logits(0.4, 0.4, 0.2)
    # KL(p||q) = 0.8 ln(0.8/0.4) + 0.1 ln(0.1/0.4) + 0.1 ln(0.1/0.2) = 0.8 ln2 - 0.2 ln2 - 0.1 ln2 = 0.5 ln2
    assert kl_divergence(p, q) == pytest.approx(0.5 * LN2, rel=1e-6)
    # KL(q||p) = 0.4 ln(0.4/0.8) + 0.4 ln(0.4/0.1) + 0.2 ln(0.2/0.1) = -0.4 ln2 + 0.8 ln2 + 0.2 ln2 = 0.6 ln2
    assert kl_divergence(q, p) == pytest.approx(0.6 * LN2, rel=1e-6)
    # logits are defined up to a constant: shifting either row changes nothing
    assert kl_divergence(p + 7.0, q - 3.0) == pytest.approx(0.5 * LN2, rel=1e-5)
    assert kl_divergence(p, p + 2.5) == pytest.approx(0.0, abs=1e-7)


def test_top_k_overlap_counts_shared_ids_with_the_sdk_tie_rule() -> None:
    z_ref = np.array([5, 4, 3, 2, 1, 0], dtype=np.float32)
    z_q = np.array([0, 4, 3, 5, 1, 2], dtype=np.float32)
    assert top_k_overlap(z_ref, z_q, 1) == 0.0  # 0 vs 3
    assert top_k_overlap(z_ref, z_q, 2) == 0.5  # {0, 1} vs {3, 1}
    assert top_k_overlap(z_ref, z_q, 3) == pytest.approx(2 / 3)  # {0, 1, 2} vs {3, 1, 2}
    assert top_k_overlap(z_ref, z_q, 6) == 1.0
    # ties go to the lower id: TopK_2([1, 1, 1, 0]) = {0, 1}, TopK_2([0, 1, 1, 1]) = {1, 2}
    assert top_k_overlap(np.array([1, 1, 1, 0.0]), np.array([0, 1, 1, 1.0]), 2) == 0.5
    with pytest.raises(ValueError):
        top_k_overlap(z_ref, z_q, 0)


# -- CoVeil's decisions given the same cloud row -------------------------------------------------------------
#
# Four tokens, the cloud uniform (p_llm = 0.25 each), alpha = 0.3, so p_fuse = 0.075 + 0.7 * p_slm.

UNIFORM = np.zeros(4, dtype=np.float32)
REF = logits(0.7, 0.1, 0.1, 0.1)  # p_fuse = [0.565, 0.145, 0.145, 0.145]


def test_edge_side_decisions_compared_by_the_synchronised_token() -> None:
    # lam = 1: J(i) = -(p_fuse(i) - p_fuse(y*)) + (p_slm(i) - p_llm(i))
    # reference: J(0) = 0.7 - 0.25 = 0.45, J(1..3) = 0.42 - 0.15 = 0.27 -> token 1 (lowest id of the ties)
    step = StepReference(REF, UNIFORM, policy=CoVeil(lam=1.0), mode="edge", alpha=0.3)
    assert step.decision.token_id == 1
    # quantised [0.1, 0.7, 0.1, 0.1]: y* = 1, J(1) = 0.45, J(0) = J(2) = J(3) = 0.27; TopK order [1, 0, 2, 3] -> token 0
    moved = step.compare(logits(0.1, 0.7, 0.1, 0.1))
    assert not moved.decision_agrees and not moved.top1_agrees
    # the same row up to a constant decides the same
    same = step.compare(REF + 3.0)
    assert same.decision_agrees and same.top1_agrees and same.kl == pytest.approx(0.0, abs=1e-7)
    assert same.overlaps == (1.0, 1.0)  # K = 10 and 100 exceed the vocabulary: all four ids shared


def test_cloud_side_decisions_compared_by_the_upload_set() -> None:
    # g(y*) = -(1 - alpha) s (1 - 1/4) + lam |s - 0.25| with s = p_slm(y*), lam = 0.5:
    # reference: y* = 0, s = 0.7: g = -0.3675 + 0.225 < 0 -> upload {0}
    step = StepReference(REF, UNIFORM, policy=CoVeil(lam=0.5), mode="cloud", alpha=0.3)
    assert step.decision.ids.tolist() == [0]
    # [0.6, 0.2, 0.1, 0.1]: y* = 0, s = 0.6: g = -0.315 + 0.175 < 0 -> {0}: the same upload from another row
    close = step.compare(logits(0.6, 0.2, 0.1, 0.1))
    assert close.decision_agrees and close.top1_agrees and close.kl > 0
    # [0.1, 0.7, 0.1, 0.1]: y* = 1 -> {1}
    assert not step.compare(logits(0.1, 0.7, 0.1, 0.1)).decision_agrees


def test_end_ids_are_floored_edge_side_while_an_end_is_not_allowed() -> None:
    # lam = 0 picks argmax p_fuse; with token 0 an end token that may not come yet, the pick is token 1
    assert StepReference(REF, UNIFORM, policy=CoVeil(lam=0.0), mode="edge", alpha=0.3).decision.token_id == 0
    assert StepReference(REF, UNIFORM, policy=CoVeil(lam=0.0), mode="edge", alpha=0.3,
                         end_ids=[0]).decision.token_id == 1


# -- teacher forcing -----------------------------------------------------------------------------------------


def test_chunked_teacher_forcing_gives_the_rows_of_one_token_at_a_time() -> None:
    from cloud_adapter.llm import TransformersLLM, TransformersSLM
    from eval_harness.compare.teacher import backend_rows, transformers_rows
    from tests.support.tiny_models import bpe_tokenizer, random_qwen

    tokenizer = bpe_tokenizer()
    model = TransformersLLM.from_loaded(random_qwen(tokenizer, output_rows=448, seed=7), tokenizer, "tiny")
    prompt = model.tokenize("The patient has jaundice.", add_bos=False)
    tokens = model.tokenize(" Which organ is affected? The liver.", add_bos=False)
    chunked = list(transformers_rows(model, prompt, tokens, chunk=3))  # chunks that do not divide the prefix
    stepped = list(backend_rows(TransformersSLM(model), prompt, tokens))
    assert len(chunked) == len(stepped) == len(tokens)
    assert all(row.shape == (model.vocab_size,) for row in chunked)
    np.testing.assert_allclose(np.stack(chunked), np.stack(stepped), atol=1e-5)


# -- the quantiser (the embedded model) ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def q2k(tmp_path_factory: pytest.TempPathFactory):
    from edge_sdk.models import embedded_gguf_path
    from eval_harness.compare.quantize import derive_variant

    cache = tmp_path_factory.mktemp("quantized")
    return derive_variant(embedded_gguf_path(), "Q2_K", cache_dir=cache), cache


@pytest.mark.model
def test_the_quantiser_writes_the_requested_type_and_llama_cpp_loads_it(q2k) -> None:
    import gguf

    from edge_sdk.backends.llama_cpp import LlamaCppSLM

    variant, cache = q2k
    assert variant.path.parent == cache and variant.derived_from == "Q4_K_M"
    slm = LlamaCppSLM(variant.path, n_ctx=64, n_threads=1)
    try:
        row = slm.prefill(slm.tokenize("The liver is swollen", add_bos=True))
    finally:
        slm.close()
    # the file type as llama.cpp's own GGUF parser reads it (not the harness's gguf-package reader; a second
    # full parse of the 262k-entry vocabulary arrays with that package costs ~10 s here)
    assert int(slm.metadata["general.file_type"]) == gguf.LlamaFileType.MOSTLY_Q2_K
    assert row.shape == (slm.vocab_size,) and np.isfinite(row).all()
    assert variant.info.matrix_bits_per_weight < 4.5 < 5.0 < variant.info.bits_per_weight  # embedding stays Q8_0


@pytest.mark.model
def test_a_variant_is_read_from_the_cache_on_the_second_call(q2k, monkeypatch: pytest.MonkeyPatch) -> None:
    from edge_sdk.models import embedded_gguf_path
    from eval_harness.compare import quantize

    variant, cache = q2k
    written = variant.path.stat().st_mtime_ns

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("quantised again")

    monkeypatch.setattr(quantize, "quantize", refuse)
    again = quantize.derive_variant(embedded_gguf_path(), "Q2_K", cache_dir=cache)
    assert again.path == variant.path and variant.path.stat().st_mtime_ns == written
    assert again.sha256 == variant.sha256
    source = quantize.derive_variant(embedded_gguf_path(), "Q4_K_M", cache_dir=cache)  # the shipped type itself
    assert source.path == embedded_gguf_path() and source.derived_from is None
    assert quantize.quant_type("q3_k") == "Q3_K_M"
    with pytest.raises(ValueError, match="unknown quantisation type"):
        quantize.quant_type("Q9_X")


# -- the command ---------------------------------------------------------------------------------------------


def test_compare_quant_refuses_a_run_without_coveil_before_loading_anything(capsys) -> None:
    from eval_harness.cli.decodeleak import main

    assert main(["compare-quant", "--policies", "undefended"]) == 1
    assert "needs coveil" in capsys.readouterr().err


def test_compare_quant_takes_its_defaults_from_a_config_file(tmp_path: Path) -> None:
    from eval_harness.cli.decodeleak import parse

    args = parse(["compare-quant"])
    assert args.limit == 20 and args.variants == ["Q8_0", "Q4_K_M", "Q3_K", "Q2_K"] and args.max_new_tokens == 256
    assert args.modes == ["cloud", "edge"] and args.dtype == "fp32"
    config = tmp_path / "quant.json"
    config.write_text(json.dumps({"variants": "Q8_0,Q2_K", "limit": 5, "max-new-tokens": 32}))
    args = parse(["compare-quant", "--config", str(config), "--limit", "3"])
    assert args.variants == ["Q8_0", "Q2_K"] and args.max_new_tokens == 32 and args.limit == 3


@pytest.mark.model
def test_a_tiny_comparison_writes_rows_table_and_figure(q2k, tmp_path: Path, models_loaded_once) -> None:
    from eval_harness.cli.decodeleak import main
    from eval_harness.sweep.store import read_rows

    _variant, cache = q2k
    out = tmp_path / "cq"
    # one item: every pass, row kind and table line is there for each mode (pairing items is the summary test's)
    assert main(["compare-quant", "--limit", "1", "--max-new-tokens", "8", "--variants", "Q2_K", "--policies", "coveil",
                 "--concurrency", "2", "--cache-dir", str(cache), "--out", str(out)]) == 0
    reference = {row["key"]: row for row in read_rows([out / "reference.jsonl"])}
    assert len(reference) == 1 * 2 and all(1 <= len(r["token_ids"]) <= 8 for r in reference.values())
    steps = list(read_rows([out / "steps.jsonl"]))
    assert sorted((r["mode"], r["variant"]) for r in steps) == [("cloud", "Q2_K"), ("edge", "Q2_K")]
    for row in steps:  # one entry per step of the reference generation it followed
        prefix = reference[row["key"].split("-", 1)[1]]
        assert row["steps"] == len(prefix["token_ids"]) == len(row["kl"]) == len(row["decision_agrees"])
        assert all(k >= 0 for k in row["kl"]) and all(0 <= x <= 1 for x in row["overlap@100"])
    variant_rows = list(read_rows([out / "Q2_K.jsonl"]))
    assert len(variant_rows) == 2 and {r["models"]["slm"]["file_type"] for r in variant_rows} == {"Q2_K"}
    assert all(r["backend"].startswith("llama.cpp edge") for r in variant_rows)
    table = (out / "table.md").read_text()
    assert "requantised from Q4_K_M" in table and "| Q2_K | Q2_K (from Q4_K_M) |" in table
    assert "| Δ Q2_K | 1 | " in table and "### edge-side coveil lam=1.0 (1 items)" in table
    summary = json.loads((out / "summary.json").read_text())
    assert summary["variants"][0]["steps"] == sum(r["steps"] for r in steps)
    assert set(summary["variants"][0]["coveil_agreement"]) == {"cloud", "edge"}
    png, pdf = out / "drift_vs_bits.png", out / "drift_vs_bits.pdf"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert pdf.read_bytes()[:5] == b"%PDF-"


# -- the summary and the table, from rows only ---------------------------------------------------------------


def _result(key: str, mode: str, correct: bool, token_er: float, tokens: list[int]) -> dict:
    metrics = {"token_er@100": token_er, "rouge1_er@100": 0.5, "span_er@100": 0.25, "auc@100": 0.1}
    return {"key": key, "mode": mode, "policy": "coveil", "params": {"lam": 1.0}, "correct": correct,
            "metrics": metrics, "token_ids": tokens}


def test_the_summary_pairs_items_and_pools_steps() -> None:
    from eval_harness.report.quant import markdown, summarise

    variant = {"name": "Q2_K", "file_type": "Q2_K", "derived_from": "Q4_K_M", "size_bytes": 237_000_000,
               "bits_per_weight": 6.88, "matrix_bits_per_weight": 4.15}
    steps = [
        {"variant": "Q2_K", "mode": "edge", "kl": [0.0, 0.1, 0.2, 0.3], "top1": [True, True, False, True],
         "overlap@10": [1.0, 0.9, 0.8, 0.7], "overlap@100": [1.0, 1.0, 1.0, 0.6],
         "decision_agrees": [True, False, True, True]},
        {"variant": "Q2_K", "mode": "cloud", "kl": [1.0], "top1": [False], "overlap@10": [0.5],
         "overlap@100": [0.4], "decision_agrees": [False]},
    ]
    reference = [_result("a", "edge", True, 0.20, [1, 2]), _result("b", "edge", False, 0.40, [1, 2])]
    # item c ran only for the variant: it has no reference to be compared with
    variants = {"Q2_K": [_result("a", "edge", False, 0.30, [1, 2]), _result("b", "edge", False, 0.60, [1, 3]),
                         _result("c", "edge", True, 0.90, [4])]}
    summary = summarise([variant], steps, reference, variants)
    q2k = summary["variants"][0]
    assert q2k["steps"] == 5 and q2k["kl_mean"] == pytest.approx(1.6 / 5)
    # 95th percentile of [0, 0.1, 0.2, 0.3, 1.0], linear between order statistics: 0.3 + 0.8 * (1.0 - 0.3)
    assert q2k["kl_p95"] == pytest.approx(0.86)
    assert q2k["top1"] == pytest.approx(3 / 5) and q2k["overlap@100"] == pytest.approx(4.0 / 5)
    assert q2k["coveil_agreement"] == {"cloud": 0.0, "edge": pytest.approx(0.75)}
    delta = q2k["end_to_end"]["edge-side coveil lam=1.0"]
    assert delta["items"] == 2 and delta["same_tokens"] == 0.5  # a and b; a decoded the same tokens
    assert delta["token_er@100"] == pytest.approx((0.10 + 0.20) / 2) and delta["span_er@100"] == 0.0
    assert delta["accuracy"] == pytest.approx(-0.5)  # a: right -> wrong, b: wrong -> wrong
    # two items: a resampled mean is d_a, the average or d_b (1/4, 1/2, 1/4), so the 95% interval is [min, max]
    assert delta["token_er@100:ci95"] == pytest.approx((0.10, 0.20)) and delta["accuracy:ci95"] == (-1.0, 0.0)
    ref = summary["reference"]["edge-side coveil lam=1.0"]
    assert ref["items"] == 2 and ref["accuracy"] == 0.5 and ref["token_er@100"] == pytest.approx(0.30)
    table = markdown(summary, title="t", preamble="p")
    assert "| Q2_K | Q2_K (from Q4_K_M) | 4.15 / 6.88 | 237.0 | 5 | 0.3200 | 0.8600 | 60.0% |" in table
    assert "| reference | 2 |  | 50.0% | 30.0% | 50.0% | 25.0% | 10.0% |" in table
    assert ("| Δ Q2_K | 2 | 50.0% | -50.0 [-100.0, +0.0] | +15.0 [+10.0, +20.0] | +0.0 [+0.0, +0.0] | "
            "+0.0 [+0.0, +0.0] | +0.0 [+0.0, +0.0] |") in table


def test_the_report_reads_rows_without_model_libraries() -> None:
    from tests.test_packaging import imported_after

    loaded = imported_after("import eval_harness.report.quant")
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "transformers", "llama_cpp", "cloud_adapter")]
