"""The embedded model in llama.cpp (edge) and transformers (cloud): one vocabulary, close distributions."""

from __future__ import annotations

import numpy as np
import pytest

from edge_sdk.fusion import softmax, top_k_ids
from edge_sdk.models import VocabularyMismatchError, check_same_vocabulary, embedded_model, resolve_model

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "Question: A 70-year-old man has congestive heart failure. Which drug improves survival?\nAnswer:",
]


@pytest.fixture(scope="module")
def llm(gemma_llm):
    return gemma_llm


def test_both_backends_share_one_vocabulary(slm, llm) -> None:
    assert slm.vocab_size == llm.vocab_size == 262_144
    check_same_vocabulary(slm.name, slm.vocab_fingerprint(), llm.name, llm.vocab_fingerprint())
    for text in PROMPTS + ["  two spaces, émigré, 3.14 µg\n"]:
        assert slm.tokenize(text, add_bos=True) == llm.tokenize(text)


def test_mismatched_vocabularies_are_refused_by_name() -> None:
    with pytest.raises(VocabularyMismatchError, match="edge-model.*cloud-model"):
        check_same_vocabulary("edge-model", b"\x00" * 32, "cloud-model", b"\x01" * 32)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_next_token_distributions_agree(slm, llm, prompt: str) -> None:
    """llama.cpp runs Q4_K_M kernels, transformers the dequantised weights: close, not equal.

    Measured here: KL(p_hf || p_llama) about 0.005 nats and 9 of the top 10 in common.
    """
    ids = slm.tokenize(prompt, add_bos=True)
    p_llama = softmax(slm.prefill(ids))
    p_hf = softmax(llm.open(ids).next_logits)
    kl = float(np.sum(p_hf * (np.log(np.maximum(p_hf, 1e-30)) - np.log(np.maximum(p_llama, 1e-30)))))
    overlap = len(set(top_k_ids(p_hf, 10).tolist()) & set(top_k_ids(p_llama, 10).tolist()))
    assert kl < 0.05, kl
    assert overlap >= 8, overlap
    assert int(np.argmax(p_hf)) == int(np.argmax(p_llama))


def test_llama_prefill_depends_on_the_prompt_alone_and_serves_a_repeat_from_the_cache(slm) -> None:
    prompt = slm.tokenize(PROMPTS[1], add_bos=True)
    other = slm.tokenize(PROMPTS[0], add_bos=True)
    fresh = slm.prefill(prompt)
    first = slm.append(int(np.argmax(fresh)))
    # whatever ran before (another prompt, a shared prefix, the prompt with a generated token), same bits
    for before in (other, prompt[:10], prompt + [int(np.argmax(fresh))], prompt[:-1]):
        slm.prefill(before)
        np.testing.assert_array_equal(slm.prefill(prompt), fresh)
    # a repeat after generating from it: no model work, the generated token dropped
    slm.prefill(prompt)
    slm.append(int(np.argmax(fresh)))
    evaluated = slm.evaluated_tokens
    np.testing.assert_array_equal(slm.prefill(prompt), fresh)
    assert slm.evaluated_tokens == evaluated and slm.tokens == prompt
    np.testing.assert_array_equal(slm.append(int(np.argmax(fresh))), first)


def test_model_resolution() -> None:
    source = embedded_model()
    assert source.gguf_path is not None and source.gguf_path.suffix == ".gguf"
    assert resolve_model(None) == source
    assert resolve_model(str(source.gguf_path)).gguf_path == source.gguf_path
    with pytest.raises(FileNotFoundError):
        resolve_model("/nowhere/model.gguf")
