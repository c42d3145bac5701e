"""Model pairs of one family: tokenizer vocabularies are compared, padded output rows are never used."""

from __future__ import annotations

import numpy as np
import pytest

from edge_sdk.client import CONTEXT_SEPARATOR, EdgeClient
from edge_sdk.fusion import fuse, softmax
from edge_sdk.models import tokenizer_vocab_size, vocab_fingerprint
from edge_sdk.policies import CoVeil, Undefended
from edge_sdk.protocol.status import CloudError

from tests.conftest import PRIVATE_CONTEXT, PUBLIC_PROMPT

STEPS = 6


def test_trailing_padding_placeholders_are_not_tokenizer_entries() -> None:
    assert tokenizer_vocab_size([b"a", b"b", b"[PAD2]", b"[PAD3]"]) == 2
    assert tokenizer_vocab_size(["a", "[PAD1]", "b"]) == 3  # only a trailing run is padding
    assert tokenizer_vocab_size(["<pad>", "<unused0>", "<unused1>"]) == 3  # defined but unused: real entries
    assert tokenizer_vocab_size(["a", "[PAD]", "[PAD1x]"]) == 3  # not the converters' "[PAD<id>]" form
    padded = ["x", "▁the", "Ġthe", "[PAD3]", "[PAD4]"]
    assert vocab_fingerprint(padded[: tokenizer_vocab_size(padded)]) == vocab_fingerprint(padded[:3])


# -- a tiny byte-level BPE family with padded output matrices -----------------------------------------


def _pad_rows_to_win(model, vocab: int) -> None:
    """Make every padding row a 10x copy of a real one: wherever a real token has a positive logit, some
    padding id beats it, so a padding row that took part in fusion would be picked."""
    import torch

    weight = model.get_output_embeddings().weight
    with torch.no_grad():
        for row in range(vocab, weight.shape[0]):
            weight[row] = 10.0 * weight[row - vocab]


@pytest.fixture(scope="module")
def tiny_family():
    from cloud_adapter.llm import TransformersLLM, TransformersSLM

    from tests.support.tiny_models import bpe_tokenizer, random_qwen

    tokenizer = bpe_tokenizer()
    vocab = len(tokenizer)
    edge_model, cloud_model = random_qwen(tokenizer, output_rows=448, seed=1), random_qwen(tokenizer, output_rows=512, seed=2)
    for model in (edge_model, cloud_model):
        _pad_rows_to_win(model, vocab)
    # the edge's tokenizer lists its padding rows as a GGUF converter writes them: "[PAD<id>]" entries
    edge_tokenizer = bpe_tokenizer()
    edge_tokenizer.add_tokens([f"[PAD{i}]" for i in range(vocab, 448)])
    assert len(edge_tokenizer) == 448
    slm = TransformersSLM(TransformersLLM.from_loaded(edge_model, edge_tokenizer, "tiny-bpe-edge (448 rows)"))
    llm = TransformersLLM.from_loaded(cloud_model, tokenizer, "tiny-bpe-cloud (512 rows)")
    return tokenizer, slm, llm


@pytest.mark.slow
def test_a_bpe_pair_padded_differently_decodes_on_the_shared_ids(tiny_family) -> None:
    from cloud_adapter.engine import CloudEngine

    tokenizer, slm, llm = tiny_family
    vocab = len(tokenizer)
    assert slm.vocab_size == llm.vocab_size == vocab < 448
    assert any(piece.startswith(b"\xc4\xa0") for piece in slm.token_strings())  # byte-level "Ġ" pieces

    # direct fused greedy on both models' rows cut to the tokenizer's ids
    z_slm = slm.prefill(slm.tokenize(PRIVATE_CONTEXT + CONTEXT_SEPARATOR + PUBLIC_PROMPT, add_bos=True))
    seq = llm.open(llm.tokenize(PUBLIC_PROMPT))
    expected = []
    for _ in range(STEPS):
        assert z_slm.shape == seq.next_logits.shape == (vocab,)
        token = int(np.argmax(fuse(softmax(seq.next_logits), softmax(z_slm), 0.3)))
        expected.append(token)
        z_slm = slm.append(token)
        llm.step([(seq, token)])

    engine = CloudEngine(llm, exposure_k=20)
    client = EdgeClient(lambda: engine.session("tests"), slm=slm)
    for mode in ("cloud", "edge"):
        result = client.generate(PUBLIC_PROMPT, PRIVATE_CONTEXT, mode=mode, policy=Undefended(), max_new_tokens=STEPS)
        assert result.token_ids == expected, mode
        coveil = client.generate(PUBLIC_PROMPT, PRIVATE_CONTEXT, mode=mode, policy=CoVeil(lam=0.5, k=20),
                                 max_new_tokens=STEPS)
        assert all(t < vocab for t in coveil.token_ids)
        assert all(i < vocab for e in coveil.ledger.entries for i in e.exposure)


def test_a_real_vocabulary_mismatch_is_refused_naming_both_models(tiny_family) -> None:
    from cloud_adapter.engine import CloudEngine
    from cloud_adapter.llm import TransformersLLM

    from tests.support.tiny_models import bpe_tokenizer, random_qwen

    _, slm, _ = tiny_family
    other = bpe_tokenizer(vocab_size=380)  # another tokenizer: other merges, other ids
    llm = TransformersLLM.from_loaded(random_qwen(other, output_rows=448, seed=3), other, "other-family")
    client = EdgeClient(lambda: CloudEngine(llm).session("tests"), slm=slm)
    with pytest.raises(CloudError) as caught:
        client.generate(PUBLIC_PROMPT, PRIVATE_CONTEXT, mode="edge", max_new_tokens=2)
    assert caught.value.code == "FAILED_PRECONDITION"
    assert "tiny-bpe-edge" in str(caught.value) and "other-family" in str(caught.value)


# -- the embedded Gemma-3 with its output matrix padded on the cloud side -----------------------------


@pytest.mark.model
def test_embedded_cloud_padded_with_resize_token_embeddings_gives_the_same_tokens(slm, gemma_llm, engine) -> None:
    import copy

    from cloud_adapter.engine import CloudEngine
    from cloud_adapter.llm import TransformersLLM

    client = EdgeClient(lambda: engine.session("tests"), slm=slm)
    # two tokens: the prefill's row and a cached step's row, either of which a padding row would win
    unpadded = {mode: client.generate(PUBLIC_PROMPT, PRIVATE_CONTEXT, mode=mode, policy=Undefended(),
                                      max_new_tokens=2).token_ids for mode in ("cloud", "edge")}

    vocab = gemma_llm.vocab_size
    model = copy.deepcopy(gemma_llm.model)  # the session's model stays as it is
    # 262,145 -> 263,168 rows; no mean initialisation (a covariance over 262k rows): the rows are set below
    model.resize_token_embeddings(vocab + 1, pad_to_multiple_of=1024, mean_resizing=False)
    rows = model.get_output_embeddings().weight.shape[0]
    assert rows == 263_168 and gemma_llm.model.get_output_embeddings().weight.shape[0] < rows
    _pad_rows_to_win(model, vocab)
    padded = TransformersLLM.from_loaded(model, gemma_llm.tokenizer, "gemma-3-270m padded to 263,168 rows")
    assert padded.vocab_size == vocab and padded.vocab_fingerprint() == slm.vocab_fingerprint()
    engine = CloudEngine(padded)
    client = EdgeClient(lambda: engine.session("tests"), slm=slm)
    for mode in ("cloud", "edge"):
        result = client.generate(PUBLIC_PROMPT, PRIVATE_CONTEXT, mode=mode, policy=Undefended(), max_new_tokens=2)
        assert result.token_ids == unpadded[mode], mode
