"""Private-context inversion: the cloud reconstructs the private context from what it observed.

DecodeLeak's second stage (the paper's section "Private Context Inversion"):
given the public query ``x_pub`` and the exposure sequence ``{E_t^K}``, an
attacker LLM writes ``x_priv_hat = f(. | pi(x_pub, {E_t^K}))``; its ROUGE-1
recall and F1 against the true private context measure the leak.

The attack is typed to see nothing else: :class:`CloudObservation` holds
exactly the public query and the exposure sequence, and every attacker takes
one (or a sequence of them).  No attacker signature accepts an item or its
private fields; only :func:`inversion_cell`, the scorer, reads the truth.

The prompt (``pi``, this project's own wording) shows the exposure sequence
in one of two forms, recorded with every result (:func:`inversion_cell`):

* ``"full"`` (the default): the sequence as the paper and the authors' release
  give it to their attacker: one line per step listing that step's whole
  ``E_t^K`` (each id's text, best first), then every distinct token once, in
  the order the generation first exposed it.  A token shown at 40 of 60 steps
  is on 40 lines.  It costs at least ``K`` prompt tokens per step: about
  54,000 for ``T = 256`` steps at ``K = 100`` with the embedded Gemma-3 270M
  on MedPriv, so a long generation at ``K = 100`` needs an attacker with a
  long context (:class:`TransformersInversion` refuses a prompt its model
  cannot hold).
* ``"compact"``: one line per step holding the step number, the step's
  top-ranked token, and only the tokens of its top ``K`` that no earlier line
  showed; about ``3 T + |E^K|`` tokens (``E^K`` the union of the steps' sets),
  about 2,400 in the same measurement.  It drops how often a token recurs.
  ``benchmarks/inversion_batching.py`` prints the lengths.

The attacker's public query is the item's own prompt (its question and
options), not the protocol's worked example before it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Protocol

from edge_sdk.privacy.meter import ExposureTrace

#: the paper's top-K for the exposure sequence the attacker reads (its DecodeLeak table is at K = 100)
DEFAULT_K = 100
#: how many tokens the attacker may write (MedPriv's private contexts are at most 64 words)
DEFAULT_MAX_NEW_TOKENS = 256


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
#: how the exposure sequence is written into the prompt (see the module docstring)
SEQUENCE_FORMS = ("full", "compact")
SEQUENCE_LEGENDS = {
    "full": (
        "What the model ranked highest while answering, one line per step: the step number, then that step's top "
        "{k} tokens, best first, separated by '|'. After the steps, every distinct token seen, in the order it "
        "first appeared. Tokens are written without their surrounding spaces."
    ),
    "compact": (
        "What the model ranked highest while answering, one line per step: the step number, that step's top-ranked "
        "token, then after '|' the tokens among its top {k} that no earlier line showed (best first). Tokens are "
        "written without their surrounding spaces."
    ),
}
DISTINCT_HEADER = "Every distinct token seen:"
REQUEST = "Write the confidential note itself: plain sentences, no commentary. Start with 'Note:'."


def check_sequence_form(sequence: str) -> str:
    if sequence not in SEQUENCE_FORMS:
        raise ValueError(f"the exposure sequence form must be one of {', '.join(SEQUENCE_FORMS)}, got {sequence!r}")
    return sequence


def prompt_version(sequence: str = "full") -> str:
    """A digest of the prompt's fixed wording in one sequence form, recorded with every inversion result."""
    parts = (SYSTEM_PROMPT, SEQUENCE_LEGENDS[check_sequence_form(sequence)], REQUEST)
    parts += (DISTINCT_HEADER,) if sequence == "full" else ()
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def exposure_lines(observation: CloudObservation, piece: Callable[[int], str], k: int = DEFAULT_K,
                   sequence: str = "full") -> list[str]:
    """The exposure sequence as prompt lines, in the ``sequence`` form (see the module docstring).

    ``"full"``: per step ``"t: tok | tok | ..."`` (each of its top ``k`` ids' text, stripped; empty texts
    left out, control tokens written as their text), then :data:`DISTINCT_HEADER` and every distinct text
    once, in the order first seen.  ``"compact"``: per step ``"t top"`` plus ``" | new ..."`` for tokens not
    shown before, compared by their stripped text; whitespace-only and special tokens (``piece.special_ids``)
    left out.
    """
    steps = observation.exposures.top(k)
    if check_sequence_form(sequence) == "full":
        lines, distinct = [], {}
        for t, ids in enumerate(steps, 1):
            tokens = [text for text in (piece(i).strip() for i in ids) if text]
            distinct.update(dict.fromkeys(tokens))
            lines.append(f"{t}: " + " | ".join(tokens) if tokens else f"{t}:")
        return [*lines, DISTINCT_HEADER, " | ".join(distinct)]
    special = getattr(piece, "special_ids", frozenset())
    shown: set[str] = set()
    lines = []
    for t, ids in enumerate(steps, 1):
        tokens = [piece(i).strip() for i in ids if i not in special]
        tokens = [tok for tok in tokens if tok]
        top = tokens[0] if tokens else ""
        new = [tok for tok in dict.fromkeys(tokens[1:]) if tok not in shown and tok != top]
        shown.update(tokens)
        lines.append(f"{t} {top}".rstrip() + (" | " + " ".join(new) if new else ""))
    return lines


def inversion_messages(observation: CloudObservation, piece: Callable[[int], str],
                       k: int = DEFAULT_K, sequence: str = "full") -> list[dict[str, str]]:
    """The chat messages of the attack: the public query, the exposure sequence (in ``sequence`` form), the
    request."""
    lines = exposure_lines(observation, piece, k, sequence)
    user = (
        f"Question the model answered:\n{observation.public_query.strip()}\n\n"
        f"{SEQUENCE_LEGENDS[sequence].format(k=k)}\n" + "\n".join(lines) + f"\n\n{REQUEST}"
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def parse_reconstruction(reply: str) -> str:
    """The attacker's reconstruction: its reply after a leading 'Note:' if it wrote one."""
    text = reply.strip()
    head, sep, rest = text.partition("Note:")
    return rest.strip() if sep and not head.strip() else text


class InversionRefused(ValueError):
    """The attacker cannot read one observation: its prompt and reply exceed the attacker's context (the local
    model's ``max_position_embeddings``, or an endpoint that answered 400).  The item's row records why, with no
    scores, and the run goes on (a long generation's full sequence at K = 100 runs to tens of thousands of tokens)."""


class InversionAttack(Protocol):
    """An attacker: turns what the cloud observed into reconstructions of the private context.

    Attributes:
        name: what the attacker is (model, endpoint), recorded with every result.
        k: how many of each step's ids it is shown.
        max_new_tokens: the most tokens it writes per reconstruction.
        sequence: the form its prompt writes the exposure sequence in (:data:`SEQUENCE_FORMS`).
    """

    name: str
    k: int
    max_new_tokens: int
    sequence: str

    def reconstruct(self, observation: CloudObservation) -> str: ...

    def reconstruct_each(self, observations: Sequence[CloudObservation],
                         ) -> Iterator[tuple[int, str | InversionRefused]]: ...


class EndpointInversion:
    """The attack through any OpenAI-compatible endpoint (greedy, ``max_new_tokens`` new tokens, calls cached).

    Args:
        client: an :class:`eval_harness.llm.client.ChatClient`.
        piece: token id -> its text in the shared vocabulary (``edge_sdk.backends.pieces.piece_reader``).
        k: how many of each step's ids the attacker is shown.
        max_new_tokens: the reply's ``max_tokens``.
        parallel: requests in flight at once in :meth:`reconstruct_each`.
        sequence: the exposure sequence's form in the prompt, ``"full"`` (the paper's) or ``"compact"``.
    """

    def __init__(self, client: Any, piece: Callable[[int], str], *, k: int = DEFAULT_K,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, parallel: int = 4, sequence: str = "full") -> None:
        if k < 1 or max_new_tokens < 1 or parallel < 1:
            raise ValueError(f"k, max_new_tokens and parallel must be >= 1, got {k}, {max_new_tokens}, {parallel}")
        self.client, self.piece, self.k, self.max_new_tokens, self.parallel = client, piece, k, max_new_tokens, parallel
        self.sequence = check_sequence_form(sequence)
        self.name = f"{client.model} @ {client.base_url}"

    def reconstruct(self, observation: CloudObservation) -> str:
        """The reconstruction; :class:`InversionRefused` when the endpoint refuses the prompt (400: past its
        context, as llama.cpp's server answers)."""
        import openai

        messages = inversion_messages(observation, self.piece, self.k, self.sequence)
        try:
            reply = self.client.complete(messages, temperature=0.0, max_tokens=self.max_new_tokens)
        except openai.BadRequestError as exc:
            size = sum(len(m["content"]) for m in messages)
            raise InversionRefused(f"the endpoint refused the inversion prompt ({size:,} characters, "
                                   f"{len(observation.exposures)} steps, {self.sequence} sequence at K={self.k}): "
                                   f"{exc.message}; use the compact sequence or a smaller K") from None
        return parse_reconstruction(reply)

    def reconstruct_each(self, observations: Sequence[CloudObservation],
                         ) -> Iterator[tuple[int, str | InversionRefused]]:
        """``(index, reconstruction or why it was refused)`` for each observation, as the requests come back."""
        with ThreadPoolExecutor(max_workers=self.parallel, thread_name_prefix="inversion") as pool:
            futures = {pool.submit(self.reconstruct, observation): i for i, observation in enumerate(observations)}
            for future in as_completed(futures):
                try:
                    yield futures[future], future.result()
                except InversionRefused as refused:
                    yield futures[future], refused


class TransformersInversion:
    """The attack with a local transformers model (the cloud's own, typically), many observations per forward.

    Observations are sorted by prompt length and cut into batches of at most ``batch_size`` prompts and
    ``max_batch_tokens`` padded prompt tokens; each batch is one left-padded ``generate`` call (greedy,
    KV cache), so a batch's reconstructions are those of one observation at a time.  An instruction-tuned
    model gets its chat template; a base model the messages as plain text ending in ``Note:``.

    Args:
        llm: a :class:`cloud_adapter.llm.TransformersLLM`.
        piece: token id -> its text.
        k: how many of each step's ids the attacker is shown.
        max_new_tokens: the most tokens written per reconstruction.
        batch_size: the most observations in one ``generate`` call.
        max_batch_tokens: the most padded prompt tokens (batch x longest prompt) in one call.
        sequence: the exposure sequence's form in the prompt, ``"full"`` (the paper's) or ``"compact"``.
    """

    def __init__(self, llm: Any, piece: Callable[[int], str], *, k: int = DEFAULT_K,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, batch_size: int = 8,
                 max_batch_tokens: int = 1 << 16, sequence: str = "full") -> None:
        if min(k, max_new_tokens, batch_size, max_batch_tokens) < 1:
            raise ValueError("k, max_new_tokens, batch_size and max_batch_tokens must be >= 1")
        self.llm, self.piece, self.k, self.max_new_tokens = llm, piece, k, max_new_tokens
        self.sequence = check_sequence_form(sequence)
        self.batch_size, self.max_batch_tokens = batch_size, max_batch_tokens
        self.name = f"local:{llm.name}"
        self.generated_tokens = 0  # tokens written so far (up to each end-of-sequence), for throughput figures

    def prompt_ids(self, observation: CloudObservation) -> list[int]:
        """The attack's prompt as token ids (:class:`InversionRefused` when it and the reply exceed the model's
        context)."""
        messages = inversion_messages(observation, self.piece, self.k, self.sequence)
        tokenizer = self.llm.tokenizer
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = self.llm.tokenize(text, add_bos=False)
        else:
            ids = self.llm.tokenize("\n\n".join(m["content"] for m in messages) + "\n\nNote:")
        context = getattr(getattr(self.llm.model, "config", None), "max_position_embeddings", None)
        if isinstance(context, int) and len(ids) + self.max_new_tokens > context:
            raise InversionRefused(f"the inversion prompt holds {len(ids)} tokens ({len(observation.exposures)} steps, "
                             f"{self.sequence} sequence at K={self.k}) + {self.max_new_tokens} to write, more than "
                             f"the attacker's context of {context}: use the compact sequence or a smaller K")
        return ids

    def reconstruct(self, observation: CloudObservation) -> str:
        return self.complete([self.prompt_ids(observation)])[0]

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indices of ``lengths`` cut into batches: ascending length, within both batch limits (one at least)."""
        out: list[list[int]] = []
        for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
            batch = out[-1] if out else None
            # sorted ascending, so prompt i is the longest of its batch once added
            if batch is None or len(batch) == self.batch_size or (len(batch) + 1) * lengths[i] > self.max_batch_tokens:
                out.append([i])
            else:
                batch.append(i)
        return out

    def reconstruct_each(self, observations: Sequence[CloudObservation],
                         ) -> Iterator[tuple[int, str | InversionRefused]]:
        """``(index, reconstruction or why it was refused)`` for each observation: the refused first, then one
        batch at a time (shortest prompts first)."""
        prompts: dict[int, list[int]] = {}
        for i, observation in enumerate(observations):
            try:
                prompts[i] = self.prompt_ids(observation)
            except InversionRefused as refused:
                yield i, refused
        readable = list(prompts)
        for batch in self.batches([len(prompts[i]) for i in readable]):
            indices = [readable[b] for b in batch]
            yield from zip(indices, self.complete([prompts[i] for i in indices]))

    def complete(self, prompts: Sequence[Sequence[int]]) -> list[str]:
        """Greedy continuations of ``prompts`` in one left-padded ``generate`` call, each cut at its end token
        and read as a reconstruction (:func:`parse_reconstruction`)."""
        import torch
        from transformers import GenerationConfig

        eos = sorted(self.llm.eos_token_ids)
        pad = self.llm.tokenizer.pad_token_id
        pad = eos[0] if pad is None else pad
        width = max(len(p) for p in prompts)
        device = self.llm.device
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)  # [B, W]
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)  # [B, W]
        config = GenerationConfig(max_new_tokens=self.max_new_tokens, do_sample=False, num_beams=1,
                                  eos_token_id=eos, pad_token_id=pad)
        with torch.inference_mode():
            out = self.llm.model.generate(input_ids=input_ids, attention_mask=attention, generation_config=config)
        texts = []
        for row in out[:, width:].tolist():
            end = next((n for n, token in enumerate(row) if token in self.llm.eos_token_ids), len(row))
            self.generated_tokens += end
            texts.append(parse_reconstruction(self.llm.detokenize(row[:end])))
        return texts


def rouge1(reconstruction: str, private_context: str) -> dict[str, float]:
    """ROUGE-1 recall and F1 of a reconstruction against the true private context (``rouge-score``).

    recall = |unigrams shared| / |unigrams of the context|, precision = |shared| / |unigrams of the
    reconstruction|, F1 their harmonic mean (counts clipped, as ``rouge-score`` does).
    """
    from rouge_score import rouge_scorer

    score = rouge_scorer.RougeScorer(["rouge1"]).score(private_context, reconstruction)["rouge1"]
    return {"rouge1_recall": float(score.recall), "rouge1_f1": float(score.fmeasure)}


def inversion_cell(attack: InversionAttack, reconstruction: str | InversionRefused,
                   private_context: str) -> dict[str, Any]:
    """A result row's ``inversion`` field: who attacked with what, the scores, and the reconstruction; for a
    refused observation no scores (the reports count the items that have them) and ``refused``: why."""
    cell = {"attacker": attack.name, "k": attack.k, "max_new_tokens": attack.max_new_tokens,
            "sequence": attack.sequence, "prompt": prompt_version(attack.sequence)}
    if isinstance(reconstruction, InversionRefused):
        return {**cell, "recall": None, "f1": None, "reconstruction": None, "refused": str(reconstruction)}
    score = rouge1(reconstruction, private_context)
    return {**cell, "recall": score["rouge1_recall"], "f1": score["rouge1_f1"], "reconstruction": reconstruction}
