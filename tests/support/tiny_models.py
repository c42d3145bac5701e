"""A tiny byte-level BPE model family built in the test session (no download): a tokenizer trained with the
``tokenizers`` library on a few sentences, and random Qwen2-architecture models over it whose output matrices
are padded past the tokenizer, as Qwen2.5's and Llama-3's are."""

from __future__ import annotations

import functools
from typing import Any

CORPUS = [
    "The patient has jaundice, a swollen liver and raised bilirubin after years of alcohol use.",
    "Which organ is affected? The liver, the heart, the lung or the kidney.",
    "She was not able to sleep because the neighbours argued until midnight about the broken fence.",
    "A 70-year-old man presents with chest pain on exertion and shortness of breath.",
    "Answer: the reason is that the context mentions the evidence in the first sentence.",
    "\n".join(["Question: what happened next?", "Options:", "(A) yes", "(B) no"]),
]
END = "<|endoftext|>"


#: the corpus the metric and piece tests train their tokenizer on (their hand-worked numbers assume it)
CLINICAL_CORPUS = (
    "the patient is not well and the liver is swollen.",
    "the doctor said the liver is not enlarged and there is no fever.",
    "the patient has jaundice; the jaundice is not new.",
    "a swollen liver and jaundice point to the liver.",
    "bilirubin is a pigment.",
    "the 70-year-old patient's liver is not in pain.\n",
)


@functools.cache
def trained_bpe(corpus: tuple[str, ...] = CLINICAL_CORPUS, vocab_size: int = 340, repeats: int = 3) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``corpus`` (deterministic: the same pieces every run)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[END], show_progress=False)
    tokenizer.train_from_iterator(list(corpus) * repeats, trainer)
    return tokenizer


def bpe_tokenizer(vocab_size: int = 400) -> Any:
    """A byte-level BPE tokenizer ("Ġthe", "Ċ" pieces) as a transformers fast tokenizer, with no BOS."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=trained_bpe(tuple(CORPUS), vocab_size, 20), eos_token=END)


def random_qwen(tokenizer: Any, *, output_rows: int, seed: int, max_positions: int = 256) -> Any:
    """A 2-layer random Qwen2 causal LM whose output matrix has ``output_rows >= len(tokenizer)`` rows."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=output_rows, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids(END), bos_token_id=None, pad_token_id=None,
    )
    return Qwen2ForCausalLM(config).eval()


def tiny_pair(seeds: tuple[int, int] = (41, 42)) -> tuple[Any, Any]:
    """An edge and a cloud :class:`~cloud_adapter.llm.TransformersLLM` over one tiny byte-level tokenizer
    (random Qwen2 models, output matrices padded to 448 rows)."""
    from cloud_adapter.llm import TransformersLLM

    tokenizer = bpe_tokenizer()
    edge, cloud = (random_qwen(tokenizer, output_rows=448, seed=seed) for seed in seeds)
    return (TransformersLLM.from_loaded(edge, tokenizer, "tiny-edge"),
            TransformersLLM.from_loaded(cloud, tokenizer, "tiny-cloud"))


def save_tiny_pair(make_dir: Any, seeds: tuple[int, int] = (41, 42)) -> tuple[str, str]:
    """The edge and cloud models of :func:`tiny_pair` saved as transformers directories (``make_dir(name)`` gives
    each an empty folder, e.g. ``tmp_path_factory.mktemp``); their paths."""
    tokenizer = bpe_tokenizer()
    dirs = []
    for name, seed in zip(("edge", "cloud"), seeds):
        directory = make_dir(name)
        random_qwen(tokenizer, output_rows=448, seed=seed).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        dirs.append(str(directory))
    return dirs[0], dirs[1]
