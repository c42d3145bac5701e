"""The two prompts of one generation: what the edge SLM reads and what the cloud reads.

The SLM conditions on the private context and the public query; the cloud only
ever receives the public query (as token ids, in the session's ``OpenSession``).

* Plain text (:func:`plain_prompts`): the SLM reads
  ``public_preamble + private_context + "\\n\\n" + public_query`` and the
  cloud ``public_preamble + public_query``, each tokenised with BOS.  The
  private context sits right before the question it informs, as in the
  authors' release; a public preamble (a worked example) comes before both.
* A conversation (:func:`chat_prompts`): both prompts are rendered with the
  model's own chat template (a :class:`ChatRenderer`, e.g.
  :class:`edge_sdk.backends.chat_template.LlamaCppChatTemplate`), never by
  string concatenation.  The cloud's is the public messages as given; the SLM's
  is the same conversation with the private context placed before the content
  of the last user message (``private_context + "\\n\\n" + content``), the
  arrangement of the plain form.  Both ends share one tokenizer (the session's
  vocabulary fingerprint checks it), so the ids mean the same to the cloud.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from edge_sdk.backends.base import SLMBackend

#: joins the private context and the public text it precedes in the SLM's prompt
CONTEXT_SEPARATOR = "\n\n"
#: the roles a conversation may use (OpenAI's ``developer`` is a ``system`` message to every chat template here)
CHAT_ROLES = frozenset({"system", "user", "assistant"})


@dataclass(frozen=True)
class Prompts:
    """The token ids each side conditions on, and the private text they differ by.

    ``slm_ids`` go to the edge SLM only; ``cloud_ids`` are sent to the cloud;
    ``private_text`` is what the leakage meter watches and what every
    ``never_upload`` span must occur in.
    """

    slm_ids: tuple[int, ...]
    cloud_ids: tuple[int, ...]
    private_text: str = ""

    def __post_init__(self) -> None:
        if not self.cloud_ids or not self.slm_ids:
            raise ValueError("the public prompt is empty: give the cloud at least one token to condition on")


class ChatRenderer(Protocol):
    """Renders a conversation with a model's chat template into the ids of the prompt that asks for its reply.

    ``stops``: text that ends the reply in this format (a chat template ends it with a special token, so none;
    :class:`QuestionAnswerPrompt` with the next question)."""

    stops: tuple[str, ...]

    def render(self, messages: Sequence[Mapping[str, str]]) -> list[int]: ...


class QuestionAnswerPrompt:
    """A conversation as a base model reads it, for a model without a chat template (the embedded Gemma-3 270M):
    system text first, then each turn as ``Question: {user}\nAnswer: {assistant}\n``, ending ``Answer:``; the
    reply ends at the next ``\nQuestion:`` (:attr:`stops`).

    A chat template such a model was never trained on makes it repeat the question; in this form it answers
    (the embedded model: "Liver" to the endpoint's example).  Tokenised with BOS, user text never read as
    control tokens.  With :func:`chat_prompts` the private context opens the last question:
    ``Question: {private_context}\n\n{question}\nAnswer:``.
    """

    stops = ("\nQuestion:",)
    source = "completion-style 'Question: ...\\nAnswer:' (the model has no chat template)"

    def __init__(self, slm: SLMBackend) -> None:
        self.slm = slm

    def text(self, messages: Sequence[Mapping[str, str]]) -> str:
        parts = []
        for message in messages:
            role, content = message["role"], message["content"]
            if role == "system":
                parts.append(f"{content}\n\n")
            elif role == "user":
                parts.append(f"Question: {content}\nAnswer:")
            else:  # an earlier answer, after its "Answer:"
                parts.append(f" {content}\n")
        return "".join(parts)

    def render(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        return self.slm.tokenize(self.text(messages), add_bos=True)


def plain_prompts(slm: SLMBackend, public_query: str, private_context: str = "", *,
                  public_preamble: str = "") -> Prompts:
    """The plain-text pair, both with BOS:

    * SLM:   ``public_preamble + private_context + CONTEXT_SEPARATOR + public_query``
    * cloud: ``public_preamble + public_query``

    ``public_preamble`` is public text both sides read first (a worked example of the answer format), so the
    private context goes right before the question it informs rather than before the example.
    """
    cloud_ids = slm.tokenize(public_preamble + public_query, add_bos=True)
    slm_ids = (
        slm.tokenize(public_preamble + private_context + CONTEXT_SEPARATOR + public_query, add_bos=True)
        if private_context else cloud_ids
    )
    return Prompts(tuple(slm_ids), tuple(cloud_ids), private_context)


def check_conversation(messages: Sequence[Mapping[str, str]]) -> int:
    """Check a conversation's shape; return the index of its last user message (where the private context goes).

    Each message has a ``role`` in :data:`CHAT_ROLES` and a string ``content``.
    """
    if not messages:
        raise ValueError("the conversation is empty")
    for position, message in enumerate(messages):
        if message.get("role") not in CHAT_ROLES:
            raise ValueError(f"message {position} has role {message.get('role')!r}; expected one of "
                             f"{', '.join(sorted(CHAT_ROLES))}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"message {position} has no text content")
    users = [i for i, message in enumerate(messages) if message["role"] == "user"]
    if not users:
        raise ValueError("the public conversation has no user message: there is no question to answer")
    return users[-1]


def chat_prompts(renderer: ChatRenderer, messages: Sequence[Mapping[str, str]], private_context: str = "") -> Prompts:
    """The conversation pair: the public ``messages`` for the cloud, and for the SLM the same messages with
    ``private_context + CONTEXT_SEPARATOR`` before the content of the last user message; both rendered by
    ``renderer`` (the model's chat template)."""
    last_user = check_conversation(messages)
    public = [{"role": m["role"], "content": m["content"]} for m in messages]
    cloud_ids = renderer.render(public)
    if not private_context:
        return Prompts(tuple(cloud_ids), tuple(cloud_ids), "")
    private = [dict(m) for m in public]
    private[last_user]["content"] = private_context + CONTEXT_SEPARATOR + private[last_user]["content"]
    return Prompts(tuple(renderer.render(private)), tuple(cloud_ids), private_context)
