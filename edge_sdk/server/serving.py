"""From an OpenAI request to a collaborative generation on the device's one SLM.

:meth:`EdgeServing.prepare_chat` / :meth:`~EdgeServing.prepare_completion`
check a request and build its prompts and decoder (the model's chat template,
the policy, ``never_upload``, the context window) before any model or network
work, so a bad request is answered at once with a 400.

**Concurrency: a queue, one slot.**  The device holds one SLM with one KV
cache, so generations run one after another, first come first served, on one
worker thread that alone touches the model.  Up to ``max_queue`` requests wait
(``429 rate_limit_exceeded`` beyond that); each response reports how long it
waited (``coveil.queue_ms``).  A second slot would need a second context and
would share the same cores: on a device the model's step is compute-bound, so
slots would not raise tokens/s, only split them.  A request whose client goes
away is dropped from the queue, or stopped at its next step (the cloud session
is closed).
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import secrets
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from edge_sdk.client import EdgeClient, GenerationStream
from edge_sdk.grammar import GrammarError
from edge_sdk.privacy.ledger import LedgerEntry, PrivacyLedger
from edge_sdk.logprobs import TokenLogprobs
from edge_sdk.policies import available_policies, make_policy
from edge_sdk.prompts import CONTEXT_SEPARATOR, ChatRenderer, Prompts, chat_prompts, plain_prompts
from edge_sdk.server.embeddings import MAX_INPUTS, DeviceEmbedder, Embedded, InputTooLong
from edge_sdk.server.errors import RETRY_AFTER_S, EndpointError, bad_request, from_cloud_error
from edge_sdk.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CoveilOptions,
    GenerationRequest,
    LedgerSummary,
    StepReport,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from edge_sdk.server.settings import ServerSettings
from edge_sdk.server.tools import chosen_tools
from edge_sdk.server.tools import instruction as tool_instruction
from edge_sdk.decode_settings import AUTO
from edge_sdk.decoding import CollaborativeDecoder
from edge_sdk.protocol import wire
from edge_sdk.protocol.status import CloudError

log = logging.getLogger("coveil.edge.server")

#: the SDK's finish reasons as OpenAI's
FINISH_REASONS = {"eos": "stop", "stop_rule": "stop", "max_new_tokens": "length"}


def cloud_saw(entry: LedgerEntry) -> str:
    """What the cloud saw at one step, the strongest first: a full-distribution request, an upload of k > 0
    values, the synchronised token (edge-side), or nothing of the private side (an empty upload)."""
    if entry.full_requested:
        return "full"
    if entry.signal == "upload":
        return "upload" if entry.values_uploaded else "nothing"
    return "token"


def step_report(entry: LedgerEntry) -> StepReport:
    return StepReport(
        step=entry.step, token_id=entry.token_id, saw=cloud_saw(entry),
        values_left=entry.values_uploaded if entry.signal == "upload" else 1, values_uploaded=entry.values_uploaded,
        full_requested=entry.full_requested, withheld=entry.withheld, steered=entry.steered,
        bytes_up=entry.bytes_up, bytes_down=entry.bytes_down, leakage_meter=entry.leak_share,
    )


#: said in the ledger of a request whose system message went to the cloud (documented, and now said where it happens)
PUBLIC_SYSTEM_NOTE = ("the system message was sent to the cloud as public text, as every unmarked message is; mark "
                      "it \"coveil_private\": true (or a text part of it) to keep it on the device")


def ledger_summary(ledger: PrivacyLedger, *, cloud_prompt_tokens: int, queue_ms: float,
                   notes: Sequence[str] = (), cut_steps: int = 0) -> LedgerSummary:
    withheld = sum(entry.withheld for entry in ledger.entries)
    return LedgerSummary(
        mode=ledger.mode, policy=ledger.policy, steps=len(ledger.entries), values_uploaded=ledger.values_uploaded,
        full_requests=ledger.full_requests, bytes_up=ledger.bytes_up, bytes_down=ledger.bytes_down,
        leakage_meter=ledger.leak_share, steered_steps=sum(entry.steered for entry in ledger.entries),
        withheld_steps=withheld, exposure_budget_spent=withheld > 0, reconnects=ledger.reconnects,
        prefill_overrun=ledger.prefill_overrun, exposure_k=ledger.exposure_k,
        cloud_prompt_tokens=cloud_prompt_tokens, queue_ms=round(queue_ms, 2),
        summary=ledger.summary(), privacy=ledger.privacy(), notes=list(notes), cut_steps=cut_steps,
    )


#: characters before the last search point searched again: a detokenised text may still rewrite its last
#: characters (a character split over byte tokens shows as U+FFFD until its last byte)
_REWRITTEN_TAIL = 16


class StopStrings:
    """OpenAI's ``stop``: the generation is complete once its text holds one of ``stops``
    (an :class:`edge_sdk.steps.StoppingRule`; ending early is always allowed).

    Called with the whole text after each token, it searches only what could hold a new occurrence: from
    ``longest stop + a rewritten tail`` characters before the end of the text it searched last, so a generation
    of n characters costs O(n · |stops|) in all, not O(n²)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._window = max(map(len, self.stops), default=0) + _REWRITTEN_TAIL
        self._searched = 0

    def allows_end(self, text: str) -> bool:
        return True

    def is_done(self, text: str) -> bool:
        start = max(0, min(self._searched, len(text)) - self._window)
        self._searched = len(text)
        return any(text.find(stop, start) >= 0 for stop in self.stops)


class StopText:
    """The part of a growing text that may be shown when it ends before the first of ``stops``.

    Shown so far is everything up to the first stop string, or, while none has
    appeared, up to the longest suffix that could still become one (held back
    until the next piece decides).  With no stops every piece shows at once.
    Each piece costs O(|piece| + |stops| · longest stop²) (only the new text and
    the stops' length behind it are searched), whatever has been fed before.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.longest = max(map(len, self.stops), default=0)
        self.text = ""
        self.shown = 0
        self.stopped = False
        self.matched: str | None = None  # the stop string the text ended at

    def feed(self, piece: str) -> str:
        """Add ``piece``; return the text that became showable."""
        if self.stopped:
            return ""
        start = max(0, len(self.text) - self.longest + 1)  # an occurrence that ends in the new piece
        self.text += piece
        found = [(at, stop) for stop in self.stops if (at := self.text.find(stop, start)) >= 0]
        if found:
            self.stopped = True
            visible, self.matched = min(found)
        else:
            tail = self.text[-self.longest :] if self.longest else ""
            held = max((n for stop in self.stops for n in range(1, min(len(stop), len(tail) + 1))
                        if tail.endswith(stop[:n])), default=0)
            visible = len(self.text) - held
        out = self.text[self.shown : visible]
        self.shown = max(self.shown, visible)
        return out

    def flush(self) -> str:
        """The generation ended without a stop string: the held-back rest."""
        if self.stopped:
            return ""
        out, self.shown = self.text[self.shown :], len(self.text)
        return out

    @property
    def result(self) -> str:
        return self.text[: self.shown]


class ShownSteps:
    """The steps a reply shows, each with its own token's text: a step is released once all its text may be shown
    (:class:`StopText` holds back what may still become a stop string), and a step whose text lies wholly past a
    stop string's cut is never released, so its log-probabilities, its stream chunk and its row on the page never
    show a token the reply does not.  The ledger still counts it (the cloud saw it): :attr:`cut`.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.text = StopText(stops)
        self.cut = 0  # steps a stop string cut whole
        self._pending: list[tuple[int, int, StepOut]] = []  # (start, end) of each held step's text

    def feed(self, step: StepOut) -> list[StepOut]:
        """``step`` (its text: the token's whole text) decided; the steps now released, in order."""
        start = len(self.text.text)
        self.text.feed(step.text)
        self._pending.append((start, start + len(step.text), step))
        return self._release()

    def flush(self) -> list[StepOut]:
        """The generation ended: every held step, or (a stop string matched) those before the cut."""
        self.text.flush()
        return self._release(ended=True)

    def _release(self, *, ended: bool = False) -> list[StepOut]:
        shown, stopped = self.text.shown, self.text.stopped
        released = []
        while self._pending:
            start, end, step = self._pending[0]
            if end > shown and not (stopped or ended):
                break  # part of its text is still held back
            self._pending.pop(0)
            if stopped and start >= shown and (end > start or start > shown):  # wholly past the cut
                self.cut += 1
                continue
            released.append(replace(step, text=self.text.text[start:min(end, shown)]))
        return released


@dataclass
class Generation:
    """One checked request, ready for the SLM."""

    request_id: str
    decoder: CollaborativeDecoder
    prompts: Prompts
    stops: tuple[str, ...]
    #: when checking the request began, before its private text was read (``time.perf_counter``; default: when this
    #: was made): the prefill budget's grid starts here, or when the previous generation ended if later
    #: (:meth:`EdgeClient.run`)
    began_at: float = field(default_factory=time.perf_counter)
    #: what the ledger's summary should tell the app about the request (:data:`PUBLIC_SYSTEM_NOTE`)
    notes: tuple[str, ...] = ()
    #: ``echo``: the prompt's text, returned before the reply; ``echo_head``: the BOS the app's token ids began
    #: with, echoed with no log-probability (the prompt's other tokens are scored when logprobs are asked for)
    echo: str | None = None
    echo_head: str | None = None
    score_prompt: bool = False  # echo with logprobs: the decoder scores the prompt once the session is over


@dataclass(frozen=True)
class StepOut:
    """A decided token: the text it made showable (maybe empty), what the cloud saw, and its log-probabilities
    when the request asked for them."""

    text: str
    report: StepReport
    logprobs: TokenLogprob | None = None


@dataclass(frozen=True)
class Done:
    """The generation ended: ``text`` is what a stop string's look-ahead still held back (shown last)."""

    finish_reason: str
    usage: Usage
    ledger: LedgerSummary
    text: str = ""
    stop_string: str | None = None  # the stop string the reply ended at (request's or the prompt format's)
    prompt_logprobs: list[TokenLogprob] | None = None  # echo with logprobs: each public prompt token's but the BOS


@dataclass(frozen=True)
class Failed:
    """The generation failed; ``ledger`` is what had left the device by then (``None``: it never started)."""

    error: EndpointError
    ledger: LedgerSummary | None = None

    def body(self) -> dict[str, Any]:
        """OpenAI's error body, with the ledger of what left beside it (``coveil``) once steps were sent."""
        body = self.error.body()
        if self.ledger is not None:
            body["coveil"] = self.ledger.model_dump()
        return body


Event = StepOut | Done | Failed


@dataclass(eq=False)
class Job:
    """A queued generation and the channel its events reach the HTTP handler by (worker thread → event loop)."""

    generation: Generation
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.perf_counter)
    withdraw: Callable[[Job], None] | None = None  # takes it out of the queue's count of waiting requests

    def put(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def next(self) -> Event:
        return await self.events.get()

    def cancel(self) -> None:
        """The client went away: drop the job (it no longer counts against ``max_queue``), or stop it at its
        next step."""
        self.cancelled.set()
        if self.withdraw is not None:
            self.withdraw(self)


#: how long a cloud adapter known to be down (its health check said so, or a generation could not reach it) has
#: requests answered 503 at once, before the next one tries it again (and pays the reconnects)
CLOUD_DOWN_S = 5.0


class EdgeServing:
    """The endpoint's engine: one :class:`EdgeClient` (one SLM), its queue and its worker thread.

    Args:
        client: the edge client (its SLM is used by the worker thread only, once serving).
        chat_template: renders conversations with the model's template (``None``: chat requests are refused).
        settings: defaults and limits.
        n_ctx: the SLM's context window.
    """

    def __init__(
        self, client: EdgeClient, chat_template: ChatRenderer | None, settings: ServerSettings, *, n_ctx: int
    ) -> None:
        self.client = client
        self.chat_template = chat_template
        self.settings = settings
        self.n_ctx = n_ctx
        self.run_context = settings.run_private_context()  # --private-context-file, read once
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued: set[Job] = set()  # submitted, not yet taken by the worker nor withdrawn
        self._running: Job | None = None
        self._slm_lock = threading.Lock()  # the SLM runs one thing at a time: a generation, or measuring the pace
        self._pieces: list[bytes] | None = None  # each id's bytes, for log-probabilities (built when first asked)
        self._embedder: DeviceEmbedder | None = None  # the SLM's GGUF loaded for embeddings (on the first request)
        self._cloud_down: tuple[float, str] | None = None  # (when, the adapter's state) while known to be down
        self._worker = threading.Thread(target=self._work, name="coveil-slm", daemon=True)
        self._worker.start()

    # -- state ---------------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._queued)

    @property
    def busy(self) -> bool:
        return self._running is not None

    @property
    def alive(self) -> bool:
        return self._worker.is_alive()

    def close(self) -> None:
        """Stop the worker after the running generation (queued ones are answered 503)."""
        self._queue.put(None)
        self._worker.join(timeout=30)

    # -- requests to generations ---------------------------------------------------------------------
    def prepare_chat(self, request: ChatCompletionRequest) -> Generation:
        """Check a chat request and build its prompts (the model's chat template on both sides) and decoder."""
        self._check_supported(request)
        options = self.options_of(request)
        self._measure_pace_if_asked(options)  # public work: before the generation's private work began
        began_at = time.perf_counter()
        if self.chat_template is None:
            raise bad_request("this model has no chat template: use /v1/completions", param="messages")
        private_parts = [m.private_text() for m in request.messages]
        private_context = "\n\n".join(part for part in [*private_parts, options.private_context] if part)
        public = [{"role": m.template_role(), "content": m.public_text()} for m in request.messages if m.is_public()]
        tools, text_allowed = chosen_tools(request.tools or [], request.tool_choice)
        if tools:  # public: the functions and the reply's shape, as the first system message
            public.insert(0, {"role": "system", "content": tool_instruction(tools, text_allowed)})
        try:
            prompts = chat_prompts(self.chat_template, public, private_context)
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None
        generation = self._generation("chatcmpl", request, options, prompts, "messages", request.reply_limit(),
                                      request.logprobs_count(), began_at, format_stops=self.chat_template.stops)
        if any(m.template_role() == "system" and m.public_text() for m in request.messages):
            generation.notes = (PUBLIC_SYSTEM_NOTE,)
        return generation

    def prepare_completion(self, request: CompletionRequest) -> Generation:
        """Check a completion request and build its plain-text prompts and decoder."""
        self._check_supported(request)
        options = self.options_of(request)
        self._measure_pace_if_asked(options)  # public work: before the generation's private work began
        began_at = time.perf_counter()
        slm = self.client.slm
        private = "\n\n".join(part for part in (request.private_text(), options.private_context) if part)
        bos = slm.tokenize("", add_bos=True)
        ids, text, head = request.prompt_ids(), request.prompt_text(), None
        if ids is not None:  # token ids, as lm-eval sends them: the cloud reads them after BOS (once)
            if not ids or any(not 0 <= i < slm.vocab_size for i in ids):
                raise bad_request(f"the prompt's token ids must be a non-empty list of ids below {slm.vocab_size}",
                                  param="prompt")
            if ids[:len(bos)] == bos:
                ids, head = ids[len(bos):], slm.detokenize(bos)
            context = slm.tokenize(private + CONTEXT_SEPARATOR, add_bos=True) if private else bos
            prompts = Prompts(tuple(context + ids), tuple(bos + ids), private)
            text = slm.detokenize(ids)
        elif not text:
            raise bad_request("the prompt is empty", param="prompt")
        else:
            prompts = plain_prompts(slm, text, private)
        prefix = None
        if request.echo_scored():  # the public tokens are scored after BOS, the private context and its separator
            if len(prompts.cloud_ids) > wire.MAX_SCORED_PROMPT_TOKENS:  # the cloud would hold (L - 1) x V logits
                raise bad_request(f"echo with logprobs scores prompts of at most {wire.MAX_SCORED_PROMPT_TOKENS} "
                                  f"tokens (this one has {len(prompts.cloud_ids)}, BOS included): shorten the "
                                  "prompt (lm-eval: max_length)", param="prompt", code="context_length_exceeded")
            prefix = slm.tokenize(private + CONTEXT_SEPARATOR, add_bos=True) if private else bos
        generation = self._generation("cmpl", request, options, prompts, "prompt", request.reply_limit(),
                                      request.logprobs_count(), began_at, prompt_prefix=prefix)
        if request.echo:
            generation.echo, generation.echo_head = (head or "") + text, head
        generation.score_prompt = prefix is not None
        return generation

    def _measure_pace_if_asked(self, options: CoveilOptions) -> None:
        """A pace of ``"auto"`` (``coveil.pace_ms``, else ``--pace-ms``): the client's, measured on a public prompt
        the first time one is asked (:meth:`~edge_sdk.client.EdgeClient.calibrated_pace_ms`; it waits for the
        running generation, since the SLM does one thing at a time); at once once measured."""
        if options.pace_ms == AUTO and not self.client.pace_measured:
            with self._slm_lock:
                self.client.calibrated_pace_ms()

    def options_of(self, request: GenerationRequest) -> CoveilOptions:
        """The request's ``coveil`` options; without a ``private_context`` of its own, the run's
        (``--private-context-file``), which then conditions the SLM as if the request had sent it; without a
        ``pace_ms`` or ``prefill_budget_ms``, the run's (``--pace-ms``, ``--prefill-budget-ms``)."""
        options = request.coveil or CoveilOptions()
        defaults: dict[str, Any] = {"pace_ms": self.settings.pace_ms, "prefill_budget_ms": self.settings.prefill_budget_ms}
        update = {name: value for name, value in defaults.items() if getattr(options, name) is None}
        if not options.private_context and self.run_context:
            update["private_context"] = self.run_context
        return options.model_copy(update=update) if update else options

    def check_model(self, model: str) -> None:
        """404 unless ``model`` is the served model's name."""
        if model != self.settings.served_model_name:
            raise EndpointError(404, f"the model {model!r} does not exist here; this endpoint serves "
                                f"{self.settings.served_model_name!r}", type="invalid_request_error",
                                param="model", code="model_not_found")

    def _check_supported(self, request: GenerationRequest) -> None:
        self.check_model(request.model)
        refused = request.unsupported()
        if refused is not None:
            raise bad_request(f"{refused[0]} is not supported: {refused[1]}", param=refused[0])

    def _generation(
        self, prefix: str, request: GenerationRequest, options: CoveilOptions, prompts: Prompts, prompt_param: str,
        reply_limit: int | None, logprobs: int | None, began_at: float, format_stops: tuple[str, ...] = (),
        prompt_prefix: list[int] | None = None,
    ) -> Generation:
        """The decoder for ``prompts`` under the request's options and the server's defaults; the reply ends at
        the request's stop strings and at the prompt format's own (``format_stops``: the next question of a
        completion-style prompt); ``logprobs``: alternatives per token with each token's log-probability."""
        prompt_tokens = len(prompts.slm_ids)
        room = self.n_ctx - prompt_tokens
        # the cloud is told max_new_tokens: a default from the SLM's room would be the private context's length
        public_room = self.n_ctx - len(prompts.cloud_ids)
        max_new_tokens = reply_limit if reply_limit is not None else min(self.settings.default_max_tokens, public_room)
        if max_new_tokens > room or room < 1:  # a reply needs at least one token of room
            asked = max(max_new_tokens, 1)
            default = "" if reply_limit is not None else " (max_tokens unset: the default, from the public prompt)"
            raise bad_request(
                f"This model's maximum context length is {self.n_ctx} tokens. However, you requested "
                f"{prompt_tokens + asked} tokens ({prompt_tokens} in the {prompt_param} and private context, "
                f"{asked} in the completion{default}). Please reduce the length of the {prompt_param}, the private "
                "context or the completion.",
                param=prompt_param, code="context_length_exceeded",
            )
        mode = options.mode or self.settings.default_mode
        if prompt_prefix is not None and mode != "edge":
            raise bad_request("echo with logprobs is served in edge-side fusion only (coveil.mode \"edge\"): "
                              "cloud-side the fused row is the cloud's, made from the policy's upload, so scoring the "
                              "prompt would upload the SLM's row at every prompt position, releases the generation "
                              "itself never makes", param="echo")
        policy_name = options.policy or self.settings.default_policy
        try:
            policy = make_policy(policy_name, backend=self.client.slm, **options.params)
        except TypeError as exc:  # a parameter the policy does not take
            raise bad_request(f"policy {policy_name!r}: {exc}", param="coveil.params") from None
        except (KeyError, ValueError) as exc:
            param = "coveil.policy" if policy_name not in available_policies() else "coveil.params"
            raise bad_request(str(exc).strip("'\""), param=param) from None
        # the cloud samples only in cloud-side fusion; edge-side the policy picks every token
        temperature = (request.temperature or 0.0) if mode == "cloud" else 0.0
        seed = request.seed if request.seed is not None else (secrets.randbits(63) if temperature > 0 else 0)
        stops = tuple(dict.fromkeys((*request.stop_strings(), *format_stops)))
        settings: dict[str, Any] = {"mode": mode, "policy": policy, "max_new_tokens": max_new_tokens,
                                    "temperature": temperature, "seed": seed, "never_upload": options.never_upload,
                                    "exposure_budget": options.exposure_budget, "max_epsilon": options.max_epsilon,
                                    "epsilon_delta": options.epsilon_delta, "pace_ms": options.pace_ms,
                                    "prefill_budget_ms": options.prefill_budget_ms, "lookahead": options.lookahead,
                                    "stopping": StopStrings(stops) if stops else None, "logprobs": logprobs,
                                    "prompt_prefix": prompt_prefix}
        if options.alpha is not None:
            settings["alpha"] = options.alpha
        schema = request.json_schema()
        if schema is not None:  # applied where the token is picked: by the edge, or by the cloud (sent with the session)
            settings["json_schema"] = schema
        for position, span in enumerate(options.never_upload):  # named by position: a span is private text
            if not span or span not in prompts.private_text:
                raise bad_request(f"coveil.never_upload[{position}] is empty or does not occur in the private "
                                  "context", param="coveil.never_upload")
        try:
            decoder = self.client.decoder(prompts, **settings)
        except GrammarError as exc:
            tools = isinstance(request, ChatCompletionRequest) and request.called_tools()
            raise bad_request(str(exc), param="tools" if tools else "response_format") from None
        except ValueError as exc:
            if options.never_upload and "never_upload" in str(exc):  # the SDK's message quotes the span
                raise bad_request("a coveil.never_upload span has no token that could be masked (only "
                                  "punctuation)", param="coveil.never_upload") from None
            raise bad_request(str(exc), param="coveil") from None
        return Generation(f"{prefix}-{secrets.token_hex(12)}", decoder, prompts, stops, began_at)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` adds to a text (the SLM's ``token_pieces``, else its detokenised text)."""
        if self._pieces is None:
            slm = self.client.slm
            self._pieces = slm.token_pieces() if callable(getattr(slm, "token_pieces", None)) else [
                slm.detokenize([i]).encode("utf-8") for i in range(slm.vocab_size)]
        return self._pieces[token_id]

    def token_logprob(self, logprobs: TokenLogprobs) -> TokenLogprob:
        """A step's log-probabilities in OpenAI's shape (a token with no probability at all, as OpenAI, -9999)."""

        def entry(token_id: int, logprob: float) -> TopLogprob:
            data = self.token_bytes(token_id)
            return TopLogprob(token=data.decode("utf-8", errors="replace"), logprob=max(logprob, -9999.0),
                              bytes=list(data))

        chosen = entry(logprobs.token_id, logprobs.logprob)
        return TokenLogprob(**chosen.model_dump(), top_logprobs=[entry(i, v) for i, v in logprobs.top])

    # -- embeddings (the device's model alone: nothing reaches the cloud) ----------------------------------
    def embed(self, texts: list[str], *, dimensions: int | None = None, truncate: bool = False) -> Embedded:
        """The unit vectors of ``texts`` from the SLM's GGUF (:mod:`edge_sdk.server.embeddings`); a bad input is
        a 400 naming it.  Blocking: call off the event loop."""
        if not texts:
            raise bad_request("input is empty: send a text or a list of texts", param="input")
        if len(texts) > MAX_INPUTS:
            raise bad_request(f"input holds {len(texts)} texts, over {MAX_INPUTS}", param="input")
        for position, text in enumerate(texts):
            if not text:
                raise bad_request(f"input[{position}] is an empty text", param="input")
        embedder = self._device_embedder()
        if dimensions is not None and dimensions != embedder.dimensions:
            raise bad_request(f"dimensions: this model's embeddings have {embedder.dimensions} dimensions; "
                              "shortened embeddings are not served (the model is not trained for them)",
                              param="dimensions")
        try:
            return embedder.embed(texts, truncate=truncate)
        except InputTooLong as exc:
            raise bad_request(str(exc), param="input", code="context_length_exceeded") from None

    def _device_embedder(self) -> DeviceEmbedder:
        path = getattr(getattr(self.client.slm, "source", None), "gguf_path", None)
        if path is None:
            raise bad_request(f"the edge model {self.client.slm.name!r} has no GGUF file to embed with",
                              param="model")
        with self._lock:
            if self._embedder is None:
                self._embedder = DeviceEmbedder(path, n_ctx=self.n_ctx, n_threads=self.settings.threads)
            return self._embedder

    # -- the cloud adapter's state ------------------------------------------------------------------
    def cloud_seen(self, state: str) -> None:
        """What the adapter's health check said (``serving``, ``not_serving``, ``unreachable``, ``unknown``), or a
        generation found: ``not_serving`` or ``unreachable`` marks it down for :data:`CLOUD_DOWN_S`."""
        with self._lock:
            if state == "serving":
                self._cloud_down = None
            elif state in ("not_serving", "unreachable"):  # "unknown" (no health service) says nothing
                self._cloud_down = (time.monotonic(), state)

    def check_cloud(self) -> None:
        """A 503 at once, with ``Retry-After``, while the adapter is known to be down (before a request is even
        checked: building its prompts may take a while)."""
        with self._lock:
            if self._cloud_down is None:
                return
            since, state = self._cloud_down
            left = CLOUD_DOWN_S - (time.monotonic() - since)
            if left <= 0:
                self._cloud_down = None  # the next request tries it
                return
        raise EndpointError(503, f"the cloud adapter is down (its state: {state}, {time.monotonic() - since:.1f} s "
                            "ago); retry later", type="service_unavailable", code="cloud_unavailable",
                            retry_after_s=max(1, math.ceil(left)))

    # -- the queue -----------------------------------------------------------------------------------
    def submit(self, generation: Generation) -> Job:
        """Queue ``generation``; its events arrive on the returned job (call from the event loop).  While the cloud
        adapter is known to be down, a 503 at once instead of a wait for reconnects."""
        self.check_cloud()
        job = Job(generation, asyncio.get_running_loop(), withdraw=self._withdraw)
        with self._lock:
            if len(self._queued) >= self.settings.max_queue:
                raise EndpointError(429, f"the device is busy: {len(self._queued)} requests are waiting for its "
                                    "model; retry later", type="rate_limit_exceeded", code="rate_limit_exceeded",
                                    retry_after_s=RETRY_AFTER_S)
            self._queued.add(job)
        self._queue.put(job)
        return job

    def _withdraw(self, job: Job) -> None:
        """A queued job's client went away: it stops counting as waiting at once (the worker skips it)."""
        with self._lock:
            self._queued.discard(job)

    def _work(self) -> None:
        if self.settings.pace_ms == AUTO:  # the run's pace, measured on public text before any request is taken
            with self._slm_lock:
                try:
                    self.client.calibrated_pace_ms()
                except Exception as exc:  # noqa: BLE001 - public work; a request asking "auto" measures again
                    log.error("measuring the pace failed with %s", type(exc).__name__)
        while True:
            job = self._queue.get()
            if job is None:
                break
            with self._lock:
                withdrawn = job not in self._queued
                self._queued.discard(job)
            if withdrawn or job.cancelled.is_set():
                continue
            self._running = job
            try:
                with self._slm_lock:
                    self._run(job)
            finally:
                self._running = None
        while True:  # closing: answer whoever still waits
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.put(Failed(EndpointError(503, "the endpoint is shutting down", type="service_unavailable")))

    def _run(self, job: Job) -> None:
        """Decode one generation, sending each step as it is decided; never raises."""
        generation = job.generation
        started = time.perf_counter()
        queue_ms = (started - job.enqueued_at) * 1e3
        shown = ShownSteps(generation.stops)
        stream: GenerationStream | None = None

        def what_left() -> LedgerSummary | None:
            if stream is None:
                return None
            return ledger_summary(stream.ledger, cloud_prompt_tokens=len(generation.prompts.cloud_ids),
                                  queue_ms=queue_ms, notes=generation.notes, cut_steps=shown.cut)

        try:
            stream = self.client.run(generation.decoder, began_at=generation.began_at)
            with stream:
                for step in stream.steps():
                    logprobs = None if step.logprobs is None else self.token_logprob(step.logprobs)
                    for out in shown.feed(StepOut(step.text, step_report(step.entry), logprobs)):
                        job.put(out)
                    if job.cancelled.is_set():
                        log.info("request %s: the client went away after %d tokens", generation.request_id,
                                 len(stream.token_ids))
                        return
                for out in shown.flush():
                    job.put(out)
                finish = "stop" if shown.text.stopped else FINISH_REASONS.get(stream.finish_reason or "", "stop")
                ledger = stream.ledger
                completion_tokens = len(stream.token_ids)
            # echo with logprobs: the SLM scores the public prompt once the session closed (nothing waits on it),
            # answering on the prefill budget's grid
            decoder = generation.decoder
            prompt_logprobs = [self.token_logprob(entry) for entry in self.client.score_prompt(
                decoder, decoder.settings.logprobs or 0)] if generation.score_prompt else None
        except CloudError as exc:
            error = from_cloud_error(exc)
            if error.code == "cloud_unavailable":
                self.cloud_seen("unreachable")
            log.warning("request %s: %s (HTTP %d)", generation.request_id, exc.code, error.status)
            job.put(Failed(error, what_left()))
            return
        except Exception as exc:  # noqa: BLE001 - a bug: the traceback's frames, never the message (may quote input)
            log.error("request %s failed with %s:\n%s", generation.request_id, type(exc).__name__,
                      "".join(traceback.format_tb(exc.__traceback__)))
            job.put(Failed(EndpointError(500, f"internal error ({type(exc).__name__})", type="server_error"),
                           what_left()))
            return
        self.cloud_seen("serving")
        prompt_tokens = len(generation.prompts.slm_ids)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)
        summary = ledger_summary(ledger, cloud_prompt_tokens=len(generation.prompts.cloud_ids), queue_ms=queue_ms,
                                 notes=generation.notes, cut_steps=shown.cut)
        job.put(Done(finish, usage, summary, "", shown.text.matched, prompt_logprobs))
        log.info(
            "request %s: %s-side %s, %d+%d tokens (%s), %d values up, %d full requests, %d B up, %d B down, "
            "leakage meter %.1f%%, queued %.0f ms, decoded in %.0f ms", generation.request_id, summary.mode,
            summary.policy, prompt_tokens, completion_tokens, finish, summary.values_uploaded,
            summary.full_requests, summary.bytes_up, summary.bytes_down, 100 * summary.leakage_meter, queue_ms,
            (time.perf_counter() - started) * 1e3,
        )

