"""The decoding protocol: the answer-letter rule, and stopping rules honoured by both ends in both modes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from cloud_adapter.engine import CloudEngine
from cloud_adapter.llm import TransformersLLM, TransformersSLM
from edge_sdk.client import EdgeClient
from eval_harness.datasets import load_task
from edge_sdk.policies import Undefended
from eval_harness.decoding_protocol import WORKED_EXAMPLE, AnswerLetterRule, DecodingProtocol
from eval_harness.runners.reference import ItemRun

from tests.support.tiny_models import END, bpe_tokenizer, random_qwen


def test_the_answer_letter_rule() -> None:
    rule = AnswerLetterRule("ABCD")
    assert not rule.allows_end("Reason: the liver is swollen.")
    assert rule.answer("Reason: jaundice.\nAnswer: C") == "C"
    assert rule.answer("Answer: (b) liver") == "B" and rule.answer("answer:<D>") == "D"
    assert rule.answer("Answer: E") is None  # not an option
    assert rule.answer("The Answer is unclear") is None
    assert rule.answer("Answer: a patient with jaundice") is None  # an article, not option A
    assert rule.answer("Answer:\n(A) Liver\n(B) Kidney") is None  # the options listed again, no choice made
    assert rule.answer("Answer: a guess.\nAnswer: (c)") == "C"  # the first line named no option; the second did
    assert rule.is_done("Reason: x\nAnswer: A") and rule.allows_end("Reason: x\nAnswer: A")


def test_the_paper_protocol_builds_the_prompt_from_public_fields_only() -> None:
    item = load_task("medpriv", 1)[0]
    protocol = DecodingProtocol()
    prompt = protocol.public_prompt(item)
    assert item.public_query.strip() in prompt and "Reason:" in prompt and "Answer:" in prompt
    assert item.private_context not in prompt
    assert all(f"({letter}) {item.options[letter].strip()}" in prompt for letter in item.options)
    assert protocol.describe()["max_new_tokens"] == 256 and protocol.describe()["alpha"] == 0.3


class TextTokenizer:
    """Tokenises text into one id per character (BOS = -1), so the ids spell back the text each side reads."""

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        return ([-1] if add_bos else []) + [ord(ch) for ch in text]


def spelled(ids: tuple[int, ...]) -> str:
    assert ids[0] == -1
    return "".join(chr(i) for i in ids[1:])


def test_the_slm_reads_its_private_context_right_before_the_question_after_the_worked_example() -> None:
    """Fails on the old prompt, which put the context before the worked example (the release: before the question)."""
    item = load_task("medpriv", 1)[0]
    protocol = DecodingProtocol()
    run = ItemRun.of(protocol, item, Undefended())
    prompts = run.prompts(TextTokenizer())  # type: ignore[arg-type]
    question = f"Question: {item.public_query.strip()}\nOptions:\n(A) "
    assert spelled(prompts.cloud_ids) == WORKED_EXAMPLE + protocol.question_prompt(item)
    assert spelled(prompts.cloud_ids) == protocol.public_prompt(item) and protocol.question_prompt(item).startswith(question)
    assert spelled(prompts.slm_ids) == WORKED_EXAMPLE + item.private_context + "\n\n" + protocol.question_prompt(item)
    # the item's public part, which the inversion attacker is given, holds no worked example
    assert "insulin" not in run.public_prompt and run.public_prompt == protocol.question_prompt(item)
    assert run.stopping == protocol.stopping(item) and protocol.describe()["preamble"] == WORKED_EXAMPLE


@dataclass(frozen=True)
class Never:
    """Never allows the end; done after ``done_after`` characters of text (0: never)."""

    done_after: int = 0

    def allows_end(self, text: str) -> bool:
        return False

    def is_done(self, text: str) -> bool:
        return bool(self.done_after) and len(text) >= self.done_after


@pytest.fixture(scope="module")
def eos_loving_pair():
    """A tiny pair whose models would say end-of-generation at once: its output row for EOS dominates."""
    tokenizer = bpe_tokenizer()
    eos = tokenizer.convert_tokens_to_ids(END)
    models = [random_qwen(tokenizer, output_rows=448, seed=seed) for seed in (31, 32)]
    for model in models:
        with torch.no_grad():
            model.get_output_embeddings().weight[eos] *= 0
            model.get_output_embeddings().bias = None
            model.get_output_embeddings().weight[eos] += 50 * model.model.norm.weight / model.model.norm.weight.norm()
    slm = TransformersSLM(TransformersLLM.from_loaded(models[0], tokenizer, "tiny-edge"))
    llm = TransformersLLM.from_loaded(models[1], tokenizer, "tiny-cloud")
    return slm, llm, eos


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cloud", "edge"])
def test_both_ends_honour_the_stopping_rule(eos_loving_pair, mode: str) -> None:
    slm, llm, eos = eos_loving_pair
    engine = CloudEngine(llm)
    client = EdgeClient(lambda: engine.session("tests"), slm=slm)
    free = client.generate("Which organ?", "The liver.", mode=mode, max_new_tokens=6)
    assert free.token_ids[-1] == eos and free.finish_reason == "eos"  # without a rule it would stop at once
    held = client.generate("Which organ?", "The liver.", mode=mode, max_new_tokens=6, stopping=Never())
    assert len(held.token_ids) == 6 and eos not in held.token_ids and held.finish_reason == "max_new_tokens"
    done = client.generate("Which organ?", "The liver.", mode=mode, max_new_tokens=6, stopping=Never(done_after=1))
    assert 1 <= len(done.token_ids) < 6 and done.finish_reason == "stop_rule"
    assert engine.active_sessions == 0  # the edge closed the session it ended
