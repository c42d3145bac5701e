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

from eval_harness.datasets import LETTERS, DecodeLeakItem

REASON_THEN_ANSWER = (
    "Question: {question}\n"
    "Options:\n{options}\n\n"
    "Think about which option fits, then answer in exactly this form:\n"
    "Reason: <one or two sentences>\n"
    "Answer: <the letter of the correct option>\n"
)

_ANSWER = re.compile(r"Answer\s*:\s*[(<]?\s*([A-Z])\b", re.IGNORECASE)


@dataclass(frozen=True)
class AnswerLetterRule:
    """An end-of-generation token may come only once ``Answer: X`` has been written; the generation ends there.

    Implements :class:`edge_sdk.session.StoppingRule`.
    """

    letters: str = "".join(LETTERS)

    def answer(self, text: str) -> str | None:
        """The option letter the text has answered, if any."""
        match = _ANSWER.search(text)
        letter = match.group(1).upper() if match else None
        return letter if letter is not None and letter in self.letters else None

    def allows_end(self, text: str) -> bool:
        return self.answer(text) is not None

    def is_done(self, text: str) -> bool:
        return self.answer(text) is not None


@dataclass(frozen=True)
class DecodingProtocol:
    """How one item is decoded: the public prompt's template, the length, the fusion weight, the stopping rule.

    Attributes:
        name: a short label for tables.
        template: the public prompt, formatted with ``{question}`` and ``{options}``.
        max_new_tokens: the most tokens generated.
        alpha: the cloud LLM's fusion weight.
        stop_at_answer: mask end-of-generation until ``Answer: X`` and stop there.
    """

    name: str = "paper"
    template: str = REASON_THEN_ANSWER
    max_new_tokens: int = 256
    alpha: float = 0.3
    stop_at_answer: bool = True

    def public_prompt(self, item: DecodeLeakItem) -> str:
        options = "\n".join(f"({letter}) {item.options[letter].strip()}" for letter in LETTERS if letter in item.options)
        return self.template.format(question=item.public_query.strip(), options=options)

    def stopping(self, item: DecodeLeakItem) -> AnswerLetterRule | None:
        return AnswerLetterRule("".join(sorted(item.options))) if self.stop_at_answer else None

    def predicted(self, item: DecodeLeakItem, generation: str) -> str | None:
        """The letter a generation answered (``None``: no answer in the expected form)."""
        return AnswerLetterRule("".join(sorted(item.options))).answer(generation)

    def describe(self) -> dict[str, object]:
        """Everything that defines the protocol, for result metadata."""
        return asdict(self)
