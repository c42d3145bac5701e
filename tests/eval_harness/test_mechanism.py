"""CoVeil's per-step mechanism statistics, the rows' metrics at every K, and a short real sweep with both.

The hand-worked cases feed ``log p`` as logits, so ``softmax`` gives back ``p``
and the fused values can be read off the comments.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud_adapter.llm import TransformersLLM, TransformersSLM
from edge_sdk.client import GenerationResult
from edge_sdk.privacy.ledger import LedgerEntry, PrivacyLedger
from edge_sdk.policies import CoVeil, Undefended
from eval_harness.datasets import DecodeLeakItem
from eval_harness.metrics import Vocabulary
from eval_harness.decoding_protocol import DecodingProtocol
from eval_harness.runners.mechanism import RANK_BINS, rank_bin, step_decisions, summarise, teacher_forced_logits
from eval_harness.runners.reference import ItemRun, ReferenceRunner
from eval_harness.sweep.execute import METRIC_KS, result_row
from eval_harness.sweep.grid import Setting

from tests.support.tiny_models import CORPUS, tiny_pair, trained_bpe

P_SLM = [0.05, 0.6, 0.3, 0.05]
P_LLM = [0.9, 0.02, 0.04, 0.04]


def rows(p: list[float], steps: int) -> torch.Tensor:
    return torch.log(torch.tensor([p] * steps, dtype=torch.float32))


def test_full_fusion_top_and_rank_hand_worked_in_both_spaces() -> None:
    slm, llm = rows(P_SLM, 4), rows(P_LLM, 4)
    # probabilities, alpha = 0.3: 0.3 * p_L + 0.7 * p_S = [0.27 + 0.035, 0.006 + 0.42, 0.012 + 0.21, 0.012 + 0.035]
    #                                                  = [0.305, 0.426, 0.222, 0.047]: order 1, 0, 2, 3
    top, ranks = step_decisions(slm, llm, [1, 0, 2, 3], alpha=0.3)
    assert top == [1, 1, 1, 1] and ranks == [1, 2, 3, 4]
    # logits: 0.3 ln p_L + 0.7 ln p_S = [-0.032 - 2.097, -1.174 - 0.358, -0.966 - 0.843, -0.966 - 2.097]
    #                                = [-2.129, -1.531, -1.809, -3.063]: order 1, 2, 0, 3
    top, ranks = step_decisions(slm, llm, [1, 0, 2, 3], alpha=0.3, space="logit")
    assert top == [1, 1, 1, 1] and ranks == [1, 3, 2, 4]
    # alpha = 1: the cloud alone, p_L = [0.9, 0.02, 0.04, 0.04]; tokens 2 and 3 tie, neither beats the other
    top, ranks = step_decisions(slm, llm, [0, 1, 2, 3], alpha=1.0)
    assert top == [0, 0, 0, 0] and ranks == [1, 4, 2, 2]


def test_end_ids_leave_the_ranking_where_ending_was_not_allowed() -> None:
    p = [0.1, 0.2, 0.1, 0.6]  # token 3 ends the generation and is everyone's favourite
    slm, llm = rows(p, 2), rows(p, 2)
    top, ranks = step_decisions(slm, llm, [1, 1], alpha=0.3, end_allowed=[False, True], stop_ids={3})
    # step 0: without token 3 the top is 1, chosen at rank 1; step 1: token 3 is back, token 1 ranks 2
    assert top == [1, 3] and ranks == [1, 2]


def test_a_tie_goes_to_the_lower_id_and_ranks_both_first() -> None:
    p = [0.4, 0.4, 0.1, 0.1]
    top, ranks = step_decisions(rows(p, 1), rows(p, 1), [1], alpha=0.3)
    assert top == [0] and ranks == [1]  # disagrees with the (tie-broken) full-fusion top, yet nothing ranks above


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="T = 3 steps"):
        step_decisions(rows(P_SLM, 2), rows(P_LLM, 2), [0, 1, 2], alpha=0.3)
    with pytest.raises(ValueError, match="space"):
        step_decisions(rows(P_SLM, 1), rows(P_LLM, 1), [0], alpha=0.3, space="log")


def test_summary_counts_hand_worked() -> None:
    chosen = [5, 5, 6, 7, 8, 9, 9]
    full_top = [5, 4, 6, 1, 8, 2, 3]  # agreements at steps 0, 2, 4
    ranks = [1, 1, 3, 6, 50, 51, 200]
    uploads = [0, 3, 0, 1, 0, 0, 2]
    got = summarise(chosen, full_top, ranks, uploads)
    assert got == {"steps": 7, "zero_upload_steps": 4, "top1_agreement_steps": 3, "rank_sum": 312,
                   "rank_mean": pytest.approx(312 / 7), "rank_bins": {"1": 2, "2-5": 1, "6-50": 2, ">50": 2}}
    assert summarise([1], [1], [1])["zero_upload_steps"] is None  # edge-side: nothing is uploaded
    assert [label for label, _, _ in RANK_BINS] == ["1", "2-5", "6-50", ">50"]
    assert (rank_bin(5), rank_bin(6), rank_bin(51)) == ("2-5", "6-50", ">50")
    with pytest.raises(ValueError):
        rank_bin(0)


# -- against real (tiny) models ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair() -> tuple[TransformersLLM, TransformersLLM]:
    return tiny_pair()


def test_teacher_forcing_gives_the_rows_decoding_saw(pair) -> None:
    slm, _ = pair
    backend = TransformersSLM(slm)
    prompt = slm.tokenize(CORPUS[0], add_bos=True)
    decoded = [backend.prefill(prompt)]
    tokens = [int(np.argmax(decoded[-1]))]
    for _ in range(4):  # token by token, with the KV cache
        decoded.append(backend.append(tokens[-1]))
        tokens.append(int(np.argmax(decoded[-1])))
    forced = teacher_forced_logits(slm.model, prompt, tokens, slm.vocab_size)
    assert forced.shape == (5, slm.vocab_size)  # padding rows past the tokenizer dropped
    np.testing.assert_allclose(forced.numpy(), np.stack(decoded), atol=1e-4)


def runs(policy) -> list[ItemRun]:
    return [ItemRun(f"item-{i}", CORPUS[1 + i], CORPUS[i], policy, rng=np.random.default_rng(i)) for i in range(2)]


@torch.inference_mode()
def full_fusion_top_by_hand(slm, llm, slm_prompt: list[int], cloud_prompt: list[int], tokens: list[int], *,
                            alpha: float) -> list[int]:
    """Per step, ``argmax(alpha * softmax(z_L) + (1 - alpha) * softmax(z_S))`` from each model's own forward over
    its prompt and the tokens before the step (written here, not with the module under test)."""
    rows = []
    for model, prompt in ((slm, slm_prompt), (llm, cloud_prompt)):
        logits = model.model(input_ids=torch.tensor([prompt + list(tokens)])).logits[0].float()
        rows.append(torch.softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(tokens), :model.vocab_size], dim=-1))
    return (alpha * rows[1] + (1 - alpha) * rows[0]).argmax(dim=-1).tolist()


@pytest.mark.parametrize("mode", ["cloud", "edge"])
def test_undefended_always_agrees_with_full_fusion(pair, mode: str) -> None:
    """Greedy undefended fusion picks the full-fusion top itself: every step agrees at rank 1."""
    slm, llm = pair
    with ReferenceRunner(slm, llm, concurrency=2) as runner:
        items = runs(Undefended())
        for item, result in zip(items, runner.run(items, mode=mode, alpha=0.3, max_new_tokens=6)):
            got = runner.mechanism(item, result, mode=mode, alpha=0.3)
            steps = len(result.token_ids)
            assert got["steps"] == steps and got["top1_agreement_steps"] == steps
            assert got["rank_sum"] == steps and got["rank_bins"]["1"] == steps
            assert got["zero_upload_steps"] == (0 if mode == "cloud" else None)  # the whole p_S goes up


def test_cloud_side_coveil_keeps_the_fused_top_whenever_it_uploads(pair) -> None:
    """In probability space CoVeil uploads nothing or exactly the full-fusion top y*: an upload always agrees."""
    slm, llm = pair
    with ReferenceRunner(slm, llm, concurrency=2) as runner:
        items = runs(CoVeil(lam=3.0))  # on these random models: some steps upload y*, some nothing
        results = runner.run(items, mode="cloud", alpha=0.3, max_new_tokens=8)
        sizes = {entry.values_uploaded for result in results for entry in result.ledger.entries}
        assert sizes == {0, 1}  # both kinds of step occur: the property below is not vacuous
        for item, result in zip(items, results):
            prompts = item.prompts(slm)
            slm_prompt, cloud_prompt = list(prompts.slm_ids), list(prompts.cloud_ids)
            tokens = result.token_ids
            top = full_fusion_top_by_hand(slm, llm, slm_prompt, cloud_prompt, tokens, alpha=0.3)
            uploads = [entry.values_uploaded for entry in result.ledger.entries]
            assert all(y == t for y, t, n in zip(tokens, top, uploads) if n > 0)
            got = runner.mechanism(item, result, mode="cloud", alpha=0.3)
            assert got["zero_upload_steps"] == uploads.count(0)
            assert got["top1_agreement_steps"] == sum(y == t for y, t in zip(tokens, top))


# -- the rows' metrics at every K --------------------------------------------------------------------


@functools.cache
def vocab() -> Vocabulary:
    return Vocabulary.from_hf(trained_bpe())


ITEM = DecodeLeakItem("x", "Which organ?", {"A": "liver", "B": "lung"},
                      "the patient has jaundice; a swollen liver and bilirubin.",
                      ("jaundice", "swollen liver", "bilirubin"), "A")


def ledger_of(steps: list[list[int]], k: int) -> PrivacyLedger:
    ledger = PrivacyLedger(mode="edge", policy="coveil", exposure_k=k)
    for t, exposure in enumerate(steps):
        ledger.entries.append(LedgerEntry(
            step=t, token_id=exposure[0], policy="coveil", signal="token", values_uploaded=0, full_requested=False,
            withheld=False, steered=False, bytes_up=0, bytes_down=0, leak_share=0.0, edge_ms=0.0, wait_ms=0.0,
            cloud_forward_ms=0.0, exposure=tuple(exposure)))
    return ledger


@settings(max_examples=15, deadline=None)
@given(st.lists(st.permutations(range(300)), min_size=1, max_size=4), st.sampled_from([100, 1000]))
def test_row_metrics_are_given_at_every_recorded_k_and_grow_with_it(orders: list[list[int]], recorded: int) -> None:
    steps = [list(order)[:recorded] for order in orders]  # each step ranks up to 300 of the vocabulary's ids
    result = GenerationResult("Answer: A", [s[0] for s in steps], ledger_of(steps, recorded), "stop_rule")
    row = result_row(Setting("medpriv", "edge", "coveil", {"lam": 1}), ITEM, result, protocol=DecodingProtocol(),
                     vocab=vocab(), metadata={}, mechanism={"steps": len(steps)})
    ks = [k for k in METRIC_KS if k <= recorded]
    assert ks[-1] == recorded and row["mechanism"] == {"steps": len(steps)}
    for suffix in ("", ":release"):
        for name in ("token_er", "rouge1_er", "span_er", "auc"):
            values = [row["metrics"][f"{name}@{k}{suffix}"] for k in ks]
            assert all(0.0 <= v <= 1.0 for v in values)
            assert values == sorted(values), (name, suffix, values)  # more ids read, never less leakage
        # AUC@K averages Token-ER@1..K, a non-decreasing sequence: never above its last term
        assert all(row["metrics"][f"auc@{k}{suffix}"] <= row["metrics"][f"token_er@{k}{suffix}"] + 1e-12 for k in ks)
    assert f"token_er@{recorded * 2}" not in row["metrics"]


# -- a short real sweep: the embedded model, CoVeil in both modes ----------------------------------------


@pytest.mark.model
def test_a_real_sweep_writes_the_mechanism_of_every_row(tmp_path: Path, models_loaded_once) -> None:
    from eval_harness.cli.decodeleak import main
    from eval_harness.sweep.store import read_rows

    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"alpha": 0.3, "cloud": {"coveil": {"lam": [1]}}, "edge": {"coveil": {"lam": [1]}}}))
    out = tmp_path / "rows.jsonl"
    # one item: a row of each mode, which is where the mechanism's fields differ
    assert main(["sweep", str(grid), "--limit", "1", "--max-new-tokens", "4", "--dtype", "fp32", "--out", str(out)]) == 0
    found = list(read_rows([out]))
    assert sorted((r["mode"], r["policy"]) for r in found) == [("cloud", "coveil"), ("edge", "coveil")]
    for row in found:
        mech = row["mechanism"]
        assert mech["steps"] == row["tokens"] > 0 and sum(mech["rank_bins"].values()) == mech["steps"]
        assert mech["rank_sum"] >= mech["steps"] and 0 <= mech["top1_agreement_steps"] <= mech["steps"]
        assert mech["rank_mean"] == pytest.approx(mech["rank_sum"] / mech["steps"])
        if row["mode"] == "cloud":
            uploads_nothing = row["uploaded_values"] == 0
            assert 0 <= mech["zero_upload_steps"] <= mech["steps"] and (mech["zero_upload_steps"] == mech["steps"]
                                                                         or not uploads_nothing)
        else:
            assert mech["zero_upload_steps"] is None
        assert {f"token_er@{k}" for k in METRIC_KS} | {f"auc@{k}:release" for k in METRIC_KS} <= set(row["metrics"])
