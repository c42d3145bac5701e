"""The decoding protocol of an audit: the prompt built from an item, the stopping rule, the lengths.

The paper's setup (appendix "Collaborative Decoding Setup") is the default:
a reason-then-answer prompt, greedy decoding, ``max_new_tokens = 256``, an
end-of-generation token masked until the answer letter has appeared, and the
generation ending once it has (as the authors' release decodes).  The
prompt's wording is this project's own; every result records the protocol
(:meth:`DecodingProtocol.describe`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from edge_sdk.decode_settings import DecodeSettings
from eval_harness.datasets import LETTERS, DecodeLeakItem

#: One worked example, read before the item by both models.  Small base models (the embedded Gemma-3 270M has no
#: chat template) follow a demonstrated format far more reliably than a described one: on 8 MedPriv items (SLM
#: input, greedy, 80 tokens) a described format was copied back as literal text, while the example gave
#: ``Answer: (X)`` in 7.  The example is invented and public; the cloud sees it as part of the public prompt.
WORKED_EXAMPLE = (
    "Question: Which organ produces insulin?\n"
    "Options:\n(A) Liver\n(B) Pancreas\n(C) Kidney\n(D) Spleen\n"
    "Reason: Insulin is made by the beta cells of the pancreatic islets.\n"
    "Answer: (B)\n\n"
)
#: The item, ending in ``Reason:`` so that the model writes its reason first.  The SLM's private context goes
#: right before it (after the worked example), where the authors' release puts it: before the question.
REASON_THEN_ANSWER = (
    "Question: {question}\n"
    "Options:\n{options}\n"
    "Reason:"
)

#: ``Answer:`` then, on the same line, a capital letter, or a letter in parentheses or angle brackets: "Answer: a
#: patient" is not an answer, nor is "Answer:" followed by the option list on the next lines.
_ANSWER = re.compile(r"(?i:answer)[ \t]*:[ \t]*(?:\(([A-Za-z])\)|<([A-Za-z])>|([A-Z])\b)")


@dataclass(frozen=True)
class AnswerLetterRule:
    """An end-of-generation token may come only once ``Answer: X`` has been written; the generation ends there.

    Implements :class:`edge_sdk.steps.StoppingRule`.
    """

    letters: str = "".join(LETTERS)

    def answer(self, text: str) -> str | None:
        """The option letter the text has answered, if any."""
        match = _ANSWER.search(text)
        if match is None:
            return None
        letter = next(group for group in match.groups() if group is not None).upper()
        return letter if letter in self.letters else None

    def allows_end(self, text: str) -> bool:
        return self.answer(text) is not None

    def is_done(self, text: str) -> bool:
        return self.answer(text) is not None


@dataclass(frozen=True)
class DecodingProtocol:
    """How one item is decoded: the public prompt's template, the length, the fusion weight, the stopping rule.

    Attributes:
        name: a short label for tables.
        preamble: public text before the item (a worked example); the SLM reads its private context after it.
        template: the item's public prompt, formatted with ``{question}`` and ``{options}``.
        max_new_tokens: the most tokens generated.
        alpha: the cloud LLM's fusion weight.
        stop_at_answer: mask end-of-generation until ``Answer: X`` and stop there.
    """

    name: str = "paper"
    preamble: str = WORKED_EXAMPLE
    template: str = REASON_THEN_ANSWER
    max_new_tokens: int = DecodeSettings.max_new_tokens
    alpha: float = DecodeSettings.alpha
    stop_at_answer: bool = True

    def question_prompt(self, item: DecodeLeakItem) -> str:
        """The item's part of the public prompt (its question and options): the SLM's private context precedes it."""
        options = "\n".join(f"({letter}) {item.options[letter].strip()}" for letter in LETTERS if letter in item.options)
        return self.template.format(question=item.public_query.strip(), options=options)

    def public_prompt(self, item: DecodeLeakItem) -> str:
        """The whole public prompt the cloud reads: the preamble, then the item."""
        return self.preamble + self.question_prompt(item)

    def stopping(self, item: DecodeLeakItem) -> AnswerLetterRule | None:
        return AnswerLetterRule("".join(sorted(item.options))) if self.stop_at_answer else None

    def predicted(self, item: DecodeLeakItem, generation: str) -> str | None:
        """The letter a generation answered (``None``: no answer in the expected form)."""
        return AnswerLetterRule("".join(sorted(item.options))).answer(generation)

    def describe(self) -> dict[str, object]:
        """Everything that defines the protocol, for result metadata."""
        return asdict(self)
