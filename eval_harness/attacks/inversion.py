"""Private-context inversion: the cloud reconstructs the private context from what it observed.

DecodeLeak's second stage (the paper's section "Private Context Inversion"):
given the public query ``x_pub`` and the exposure sequence ``{E_t^K}``, an
attacker LLM writes ``x_priv_hat``; its ROUGE-1 recall and F1 against the
true private context measure the leak.

The attack is typed to see nothing else: :class:`CloudObservation` holds
exactly the public query and the exposure sequence, and every attacker takes
one.  No attacker signature accepts an item or its private fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from edge_sdk.leakage import ExposureTrace


@dataclass(frozen=True)
class CloudObservation:
    """Everything an inversion attack may use: what the cloud saw in one generation.

    Attributes:
        public_query: the public prompt the cloud received.
        exposures: the per-step exposure sets ``E_t^K`` (token ids, best first).
    """

    public_query: str
    exposures: ExposureTrace


SYSTEM_PROMPT = (
    "You are auditing a collaborative text generator. A second model answered a question while reading a "
    "confidential note you cannot see. At every step of its answer you saw the tokens it ranked highest; those "
    "rankings were shaped by the note. Reconstruct the confidential note as faithfully as you can."
)


def inversion_messages(observation: CloudObservation, piece: Callable[[int], str], k: int = 100) -> list[dict[str, str]]:
    """The chat messages of the attack: the question, each step's top-``k`` tokens, and the tokens seen at all."""
    steps = observation.exposures.top(k)
    lines = []
    seen: dict[str, None] = {}
    for t, ids in enumerate(steps, 1):
        tokens = [piece(i).strip() for i in ids]
        tokens = [tok for tok in tokens if tok]
        lines.append(f"step {t}: " + " | ".join(tokens))
        seen.update(dict.fromkeys(tokens))
    user = (
        f"Question the model answered:\n{observation.public_query.strip()}\n\n"
        f"Highest-ranked tokens at each step (best first):\n" + "\n".join(lines) + "\n\n"
        f"Every distinct token seen: {', '.join(seen)}\n\n"
        "Write the confidential note itself: plain sentences, no commentary. Start with 'Note:'."
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def parse_reconstruction(reply: str) -> str:
    """The attacker's reconstruction: its reply after a leading 'Note:' if it wrote one."""
    text = reply.strip()
    head, sep, rest = text.partition("Note:")
    return rest.strip() if sep and not head.strip() else text


class InversionAttack(Protocol):
    """An attacker: turns what the cloud observed into a reconstruction of the private context."""

    def reconstruct(self, observation: CloudObservation) -> str: ...


class EndpointInversion:
    """The attack through any OpenAI-compatible endpoint (greedy, ``max_tokens`` new tokens, calls cached).

    Args:
        client: an :class:`eval_harness.llm.client.ChatClient`.
        piece: token id → its text in the shared vocabulary (``edge_sdk.leakage.piece_reader``).
        k: how many of each step's ids the attacker is shown.
    """

    def __init__(self, client: object, piece: Callable[[int], str], *, k: int = 100, max_tokens: int = 256) -> None:
        self.client, self.piece, self.k, self.max_tokens = client, piece, k, max_tokens

    def reconstruct(self, observation: CloudObservation) -> str:
        messages = inversion_messages(observation, self.piece, self.k)
        reply = self.client.complete(messages, temperature=0.0, max_tokens=self.max_tokens)  # type: ignore[attr-defined]
        return parse_reconstruction(reply)


class TransformersInversion:
    """The attack with a local transformers model (the cloud's own, typically): greedy, its chat template.

    Args:
        llm: a :class:`cloud_adapter.llm.TransformersLLM`.
        piece: token id → its text.
    """

    def __init__(self, llm: object, piece: Callable[[int], str], *, k: int = 100, max_new_tokens: int = 256) -> None:
        self.llm, self.piece, self.k, self.max_new_tokens = llm, piece, k, max_new_tokens

    def reconstruct(self, observation: CloudObservation) -> str:
        import numpy as np

        llm = self.llm
        messages = inversion_messages(observation, self.piece, self.k)
        tokenizer = llm.tokenizer  # type: ignore[attr-defined]
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        else:  # a base model: the two messages as plain text
            ids = llm.tokenize("\n\n".join(m["content"] for m in messages) + "\n\nNote:")  # type: ignore[attr-defined]
        seq = llm.open(list(ids))  # type: ignore[attr-defined]
        out: list[int] = []
        for _ in range(self.max_new_tokens):
            token = int(np.argmax(seq.next_logits))
            if token in llm.eos_token_ids:  # type: ignore[attr-defined]
                break
            out.append(token)
            llm.step([(seq, token)])  # type: ignore[attr-defined]
        return parse_reconstruction(llm.detokenize(out))  # type: ignore[attr-defined]


def rouge1(reconstruction: str, private_context: str) -> dict[str, float]:
    """ROUGE-1 recall and F1 of a reconstruction against the true private context (``rouge-score``)."""
    from rouge_score import rouge_scorer

    score = rouge_scorer.RougeScorer(["rouge1"]).score(private_context, reconstruction)["rouge1"]
    return {"rouge1_recall": float(score.recall), "rouge1_f1": float(score.fmeasure)}

