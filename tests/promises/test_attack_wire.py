"""Attack review of issue 19 over a real gRPC stream: what the cloud's server sees of the edge's timing.

A finding of the review: it failed on the code the review started from.  The server here is a bare gRPC handler
that records when the stream began and when each message arrived, and answers as the lying cloud of
``tests/promises/test_malicious_cloud.py`` does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import pytest

from edge_sdk._wire import coveil_pb2
from edge_sdk.client import CLOUD_SERVICE, Credentials, EdgeClient
from edge_sdk.policies import make_policy
from edge_sdk.server.openai.protocol import CompletionRequest
from edge_sdk.server.serving import Done, EdgeServing, Failed
from edge_sdk.server.settings import ServerSettings
from tests.promises.test_malicious_cloud import LyingCloud, PeakSLM
from tests.support.side_by_side import side_by_side

T = TypeVar("T")

#: the SLM's prefill takes this long per token of its prompt (the private context is most of it)
PREFILL_S_PER_TOKEN = 0.002


class SlowPrefillSLM(PeakSLM):
    """Prefill costs ``PREFILL_S_PER_TOKEN`` per prompt token (one token per character); ``prefilled_at`` is when the
    last prefill ended (``time.perf_counter``, the clock the server here records with)."""

    prefilled_at = 0.0

    def prefill(self, ids: list[int]) -> Any:
        time.sleep(PREFILL_S_PER_TOKEN * len(ids))
        self.prefilled_at = time.perf_counter()
        return super().prefill(ids)


@contextmanager
def timed_server_running() -> Iterator[tuple[int, list[tuple[str, float]]]]:
    """A gRPC server on loopback recording ``("stream", t)`` when a Decode stream begins and ``(kind, t)`` for
    each message of the edge's; it answers as a :class:`LyingCloud` with no probe set, two tokens long."""
    arrivals: list[tuple[str, float]] = []

    def decode(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
        arrivals.append(("stream", time.perf_counter()))
        cloud = LyingCloud(frozenset(), [], breaks=[0], max_new_tokens=2)
        for data in requests:
            message = coveil_pb2.EdgeMessage.FromString(data)
            arrivals.append((message.WhichOneof("kind"), time.perf_counter()))
            yield from cloud.handle(message)

    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    method = grpc.stream_stream_rpc_method_handler(
        decode, request_deserializer=None, response_serializer=coveil_pb2.CloudMessage.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(CLOUD_SERVICE, {"Decode": method}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port, arrivals
    finally:
        server.stop(0)


@pytest.fixture
def timed_server() -> Iterator[tuple[int, list[tuple[str, float]]]]:
    """One :func:`timed_server_running`."""
    with timed_server_running() as server:
        yield server


@pytest.fixture
def timed_servers() -> Iterator[tuple[tuple[int, list[tuple[str, float]]], ...]]:
    """Two :func:`timed_server_running`, for two runs side by side (``tests.support.side_by_side``: each run sleeps
    nearly all its time, and each server records its own client's messages)."""
    with timed_server_running() as first, timed_server_running() as second:
        yield first, second


def test_the_cloud_cannot_time_the_slm_s_prefill_from_when_the_stream_began(timed_server) -> None:
    """Finding: the SDK started the gRPC ``Decode`` stream (``connect()``) before the SLM prefilled the private
    prompt, and sent the open after it.  The server sees a stream begin when its headers arrive, so the time from
    the stream's start to the open was the prefill's: 16 ms for a 5-character private context, 420 ms for a
    200-character one here, and the adapter logs it as ``open_ms`` for every session.  "Prefilled before the
    session opens" must hold for the stream too: the stream may begin only once the prefill is done (server and
    edge share one process here, so one clock says which came first, however busy the machine)."""
    port, arrivals = timed_server
    for length in (5, 200):
        arrivals.clear()
        slm = SlowPrefillSLM()
        with EdgeClient(f"127.0.0.1:{port}", slm=slm, credentials=Credentials(plaintext=True)) as client:
            client.generate("q", "x" * length, mode="edge", policy=make_policy("coveil"), max_new_tokens=2)
        kinds = [kind for kind, _ in arrivals]
        assert kinds[:2] == ["stream", "open"], kinds
        assert arrivals[0][1] >= slm.prefilled_at, (length, 1e3 * (slm.prefilled_at - arrivals[0][1]))


def opens_after_previous_session(port: int, arrivals: list[tuple[str, float]], second_context: str,
                                 **settings: float) -> tuple[float, bool]:
    """Two back-to-back generations on one client: ms from the first session's last message to the second's open,
    and whether the second's prefill ran past its budget."""
    arrivals.clear()
    with EdgeClient(f"127.0.0.1:{port}", slm=SlowPrefillSLM(), credentials=Credentials(plaintext=True)) as client:
        client.generate("q", "first", mode="edge", policy=make_policy("coveil"), max_new_tokens=2, **settings)
        second = client.generate("q", second_context, mode="edge", policy=make_policy("coveil"), max_new_tokens=2,
                                 **settings)
    return gap_before_second_open(arrivals), second.ledger.prefill_overrun


def gap_before_second_open(arrivals: list[tuple[str, float]]) -> float:
    """ms from the first session's last message to the second session's open, as the server saw them."""
    opens = [i for i, (kind, _) in enumerate(arrivals) if kind == "open"]
    assert len(opens) == 2
    last_of_first = max(at for i, (kind, at) in enumerate(arrivals[: opens[1]]) if kind != "stream")
    return 1e3 * (arrivals[opens[1]][1] - last_of_first)


def for_each_length(servers: tuple[tuple[int, list[tuple[str, float]]], ...],
                    run: Callable[[int, list[tuple[str, float]], int], T], lengths: tuple[int, ...] = (5, 400),
                    ) -> dict[int, T]:
    """``run(port, arrivals, length)`` for each of ``lengths`` (private contexts of that many characters), side by
    side, each against a server of its own."""
    results = side_by_side(*(partial(run, port, arrivals, length)
                             for (port, arrivals), length in zip(servers, lengths, strict=True)))
    return dict(zip(lengths, results))


@pytest.mark.slow
def test_the_cloud_cannot_time_the_next_prefill_from_the_gap_between_two_sessions(timed_servers) -> None:
    """Finding: the endpoint runs queued generations one after another on one client (one gRPC channel, one
    bearer token, so the cloud links the sessions).  Session N+1 opened once its SLM prefill was done, which starts
    when session N ends: the gap between N's last message and N+1's open was N+1's prefill, which grows with its
    private context (and is ~0 for a private prompt served from the SLM's cache).  Here: a 5- vs 400-character
    second context (prefills of ~10 ms and ~800 ms).  With ``prefill_budget_ms`` the open leaves on a grid that
    starts when the generation began, so the gap is one budget either way (without it: 20 vs 820 ms)."""
    gaps = for_each_length(timed_servers, lambda port, arrivals, length: opens_after_previous_session(
        port, arrivals, "x" * length, prefill_budget_ms=1000))
    assert not gaps[5][1] and not gaps[400][1]
    assert abs(gaps[400][0] - gaps[5][0]) < 400, gaps
    assert all(900 < gap < 1400 for gap, _ in gaps.values()), gaps  # one budget, less what the first's end took


def test_a_prefill_past_its_budget_opens_a_budget_later_and_says_so(timed_servers) -> None:
    """A prefill longer than the budget (~800 ms against 300 ms) opens at a later point of the grid (here the
    third, ~900 ms after the generation began), and the ledger says the budget was overrun; the default has no
    budget and opens as soon as the SLM has prefilled."""
    (over_port, over_arrivals), (plain_port, plain_arrivals) = timed_servers
    (gap, overrun), (plain_gap, plain_overrun) = side_by_side(
        lambda: opens_after_previous_session(over_port, over_arrivals, "x" * 400, prefill_budget_ms=300),
        lambda: opens_after_previous_session(plain_port, plain_arrivals, "x" * 5))
    assert overrun and 850 < gap < 1300, gap
    assert not plain_overrun and plain_gap < 250, plain_gap


#: the SLM's tokenizer takes this long per character it reads
TOKENIZE_S_PER_CHARACTER = 0.001


class SlowTokenizerSLM(PeakSLM):
    """Tokenising costs ``TOKENIZE_S_PER_CHARACTER`` per character (a long private context takes a while)."""

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        time.sleep(TOKENIZE_S_PER_CHARACTER * len(text))
        return super().tokenize(text, add_bos=add_bos)


def endpoint_opens_after_answer(port: int, arrivals: list[tuple[str, float]], slm: PeakSLM,
                                first: dict[str, Any], second: dict[str, Any]) -> tuple[float, Done]:
    """Two requests to the endpoint's engine (``CompletionRequest`` fields), the second sent as soon as the first
    is answered (an app asking one question after another): ms from the first session's last message to the
    second's open, and the first's answer."""
    arrivals.clear()
    client = EdgeClient(f"127.0.0.1:{port}", slm=slm, credentials=Credentials(plaintext=True))
    serving = EdgeServing(client, None, ServerSettings(cloud=f"127.0.0.1:{port}"), n_ctx=4096)

    async def ask(request: dict[str, Any]) -> Done:
        prepared = await asyncio.to_thread(serving.prepare_completion, CompletionRequest(model="coveil", **request))
        job = serving.submit(prepared)  # as the route does
        while not isinstance(event := await job.next(), Done):
            assert not isinstance(event, Failed), event
        return event

    async def one_after_another() -> Done:
        answer = await ask(first)
        await ask(second)
        return answer

    try:
        answer = asyncio.run(one_after_another())
    finally:
        serving.close()
        client.close()
    return gap_before_second_open(arrivals), answer


def endpoint_opens_after_previous_request(port: int, arrivals: list[tuple[str, float]], second_context: str,
                                          budget_ms: float) -> float:
    """Two plain requests, the second under ``second_context``, tokenised slowly: the gap before its open."""
    def request(context: str) -> dict[str, Any]:
        return {"prompt": "q", "max_tokens": 2, "coveil": {
            "private_context": context, "mode": "edge", "policy": "coveil", "prefill_budget_ms": budget_ms}}
    return endpoint_opens_after_answer(port, arrivals, SlowTokenizerSLM(), request("first"),
                                       request(second_context))[0]


@pytest.mark.slow
def test_on_the_endpoint_the_gap_between_two_sessions_says_nothing_of_tokenising_the_next_context(
        timed_servers) -> None:
    """Finding: the endpoint's grid began when its worker took the request, after the request was checked and
    its prompts tokenised (``prepare_*``, whose time grows with the private context).  An app that asks its next
    question once the last is answered found the worker idle, so the gap between the two sessions was one budget
    plus the tokenising: 2.52 s vs 3.31 s for a 5- vs 400-character context here (2.5 s budget, tokenising at 1 ms a
    character).  The grid starts when checking the request began, before its private text is read."""
    gaps = for_each_length(timed_servers, lambda port, arrivals, length: endpoint_opens_after_previous_request(
        port, arrivals, "x" * length, budget_ms=2500))
    assert abs(gaps[400] - gaps[5]) < 250, gaps


@pytest.mark.slow
def test_a_decoder_built_then_run_opens_one_budget_after_the_previous_session_whatever_its_tokenising(
        timed_servers) -> None:
    """Finding: ``EdgeClient.run`` (build a decoder to check a request first, then run it) started the grid when
    it was called, after ``decoder()`` had tokenised the private text, so the gap since the previous session was
    one budget plus the tokenising (1.52 s vs 2.31 s for a 5- vs 400-character context here, 1.5 s budget).  The
    grid starts when ``decoder()`` began."""
    def built_then_run(port: int, arrivals: list[tuple[str, float]], length: int) -> float:
        with EdgeClient(f"127.0.0.1:{port}", slm=SlowTokenizerSLM(), credentials=Credentials(plaintext=True)) as client:
            client.generate("q", "first", mode="edge", policy="coveil", max_new_tokens=2)
            decoder = client.decoder("q", "x" * length, mode="edge", policy="coveil", max_new_tokens=2,
                                     prefill_budget_ms=1500)
            list(client.run(decoder))
        return gap_before_second_open(arrivals)

    gaps = for_each_length(timed_servers, built_then_run)
    assert abs(gaps[400] - gaps[5]) < 250, gaps
    assert all(1400 < gap < 1900 for gap in gaps.values()), gaps  # one budget, less what the first's end took


@pytest.mark.slow
def test_a_decoder_built_while_the_previous_generation_ran_opens_one_budget_after_that_generation_ended(
        timed_servers) -> None:
    """A decoder built before the previous generation ended (a request queued while another runs) starts its grid
    when that generation ended, which the cloud saw.  Started at the decoder's build (the fix above, without this
    floor), the open came at the grid's first point after the prefill, so the gap since the previous session
    showed whether the prefill crossed a point of a grid the cloud can place (690 ms for a 10 ms prefill, 1,690 ms
    for an 800 ms one here)."""
    def queued_then_run(port: int, arrivals: list[tuple[str, float]], length: int) -> float:
        with EdgeClient(f"127.0.0.1:{port}", slm=SlowPrefillSLM(), credentials=Credentials(plaintext=True)) as client:
            queued = client.decoder("q", "x" * length, mode="edge", policy="coveil", max_new_tokens=2,
                                    prefill_budget_ms=1000)
            client.generate("q", "x" * 150, mode="edge", policy="coveil", max_new_tokens=2)  # ~300 ms of prefill
            list(client.run(queued))
        return gap_before_second_open(arrivals)

    gaps = for_each_length(timed_servers, queued_then_run)
    assert abs(gaps[400] - gaps[5]) < 400, gaps
    assert all(900 < gap < 1400 for gap in gaps.values()), gaps


def endpoint_opens_after_scored_prompt(port: int, arrivals: list[tuple[str, float]], scored_context: str,
                                       budget_ms: float) -> float:
    """An lm-eval run on the endpoint: a prompt scored (echo with logprobs) under ``scored_context``, then the next
    request sent as soon as that one is answered; ms from the scored session's last message to the next open."""
    options = {"mode": "edge", "policy": "coveil", "prefill_budget_ms": budget_ms}
    gap, scored = endpoint_opens_after_answer(
        port, arrivals, SlowPrefillSLM(),
        {"prompt": [5, 6, 7, 8], "echo": True, "logprobs": 1, "max_tokens": 2,
         "coveil": {**options, "private_context": scored_context}},
        {"prompt": "q", "max_tokens": 2, "coveil": {**options, "private_context": "next"}})
    assert scored.prompt_logprobs is not None and len(scored.prompt_logprobs) == 4  # after the BOS
    return gap


@pytest.mark.slow
def test_on_the_endpoint_scoring_a_prompt_says_nothing_of_the_private_context_to_the_next_open(timed_servers) -> None:
    """Finding: echo with logprobs scores the prompt after the session closed, where the SLM prefills the private
    context again and steps over the public prompt (~10 ms vs ~800 ms here for a 5- vs 400-character context).
    An app (lm-eval) sends its next request once this one is answered, so the next open came one budget after
    the answer, and the gap since the close was the scoring plus a budget: 1,520 vs 2,310 ms with a 1.5 s budget.
    With a budget the answer now leaves on the budget's grid from the close, so the gap is two budgets either way."""
    gaps = for_each_length(timed_servers, lambda port, arrivals, length: endpoint_opens_after_scored_prompt(
        port, arrivals, "x" * length, budget_ms=1500))
    assert abs(gaps[400] - gaps[5]) < 400, gaps
    assert all(2900 < gap < 3400 for gap in gaps.values()), gaps  # two budgets, less what the first's end took


def endpoint_opens_with_a_request_arriving_while_the_scored_answer_waits(
        port: int, arrivals: list[tuple[str, float]], second_context: str, budget_ms: float,
        delay_s: float) -> tuple[float, bool]:
    """A scored prompt (5-character context), and ``delay_s`` after its session closed another app's request under
    ``second_context``, while the scored answer waits for its grid point: ms from the scored session's last message
    to the second's open, and whether the second says its prefill overran."""
    arrivals.clear()
    client = EdgeClient(f"127.0.0.1:{port}", slm=SlowPrefillSLM(), credentials=Credentials(plaintext=True))
    serving = EdgeServing(client, None, ServerSettings(cloud=f"127.0.0.1:{port}"), n_ctx=4096)
    options = {"mode": "edge", "policy": "coveil", "prefill_budget_ms": budget_ms}

    async def ask(request: dict[str, Any]) -> Done:
        prepared = await asyncio.to_thread(serving.prepare_completion, CompletionRequest(model="coveil", **request))
        job = serving.submit(prepared)
        while not isinstance(event := await job.next(), Done):
            assert not isinstance(event, Failed), event
        return event

    async def overlapping() -> Done:
        scored = asyncio.create_task(ask({"prompt": [5, 6, 7, 8], "echo": True, "logprobs": 1, "max_tokens": 2,
                                          "coveil": {**options, "private_context": "x" * 5}}))
        while sum(kind == "signal" for kind, _ in arrivals) < 2:  # the scored session's last message
            await asyncio.sleep(0.001)
        await asyncio.sleep(delay_s)
        second = asyncio.create_task(ask({"prompt": "q", "max_tokens": 2,
                                          "coveil": {**options, "private_context": second_context}}))
        await scored
        return await second

    try:
        second = asyncio.run(overlapping())
    finally:
        serving.close()
        client.close()
    return gap_before_second_open(arrivals), second.ledger.prefill_overrun


@pytest.mark.slow
def test_a_request_arriving_while_a_scored_answer_waits_opens_at_a_time_that_says_nothing_of_its_context(
        timed_servers) -> None:
    """Finding of the review of the fix above: a request arriving while the scored answer waited for its grid
    point started its grid when it arrived, but its prefill could only begin once the answer left, so it opened a
    budget later exactly when its prefill outlasted what was left of the wait, and said it overran: 2,006 vs
    3,506 ms for a 5- vs 400-character context arriving 0.5 s after the close (1.5 s budget).  The client's next
    grid now starts no earlier than the answer's grid point: 3,000 ms either way, no overrun."""
    seen = for_each_length(timed_servers, lambda port, arrivals, length: (
        endpoint_opens_with_a_request_arriving_while_the_scored_answer_waits(
            port, arrivals, "x" * length, budget_ms=1500, delay_s=0.5)))
    assert not seen[5][1] and not seen[400][1], seen
    assert abs(seen[400][0] - seen[5][0]) < 400, seen
    assert all(2900 < gap < 3400 for gap, _ in seen.values()), seen


#: the SLM reads one token's text (its vocabulary has no table) in this long
PIECE_S = 0.002


class SlowVocabularySLM(PeakSLM):
    """No vocabulary table: each token's text is read by detokenising it, ``PIECE_S`` per token (``never_upload``'s
    folded vocabulary then takes ``PIECE_S * vocab_size`` to build)."""

    def detokenize(self, ids: list[int]) -> str:
        time.sleep(PIECE_S * len(ids))
        return super().detokenize(ids)


@pytest.mark.slow
def test_the_first_masked_generation_on_a_client_opens_when_an_unmasked_one_would(timed_servers) -> None:
    """Finding: whether a generation masks spans must not change when its session opens.  The client folded the
    whole vocabulary at its first ``never_upload`` (here 512 tokens at 2 ms: ~1 s; Gemma-3's 262,144 pieces take
    0.5-1.5 s and ~65-87 MB), after the grid began: with a 600 ms budget the masked generation opened at the grid's
    third point (1.81 s after the previous session), the unmasked one at its first (0.61 s).  The client now folds
    it once in the background from its creation, and every generation waits for it, masked or not."""
    def second_opens_after(port: int, arrivals: list[tuple[str, float]], spans: tuple[str, ...]) -> float:
        with EdgeClient(f"127.0.0.1:{port}", slm=SlowVocabularySLM(), credentials=Credentials(plaintext=True)) as client:
            client.generate("q", "first", mode="edge", policy="coveil", max_new_tokens=2)
            client.generate("q", "Maria came", mode="edge", policy="coveil", max_new_tokens=2, never_upload=spans,
                            prefill_budget_ms=600)
        return gap_before_second_open(arrivals)

    unmasked, masked = side_by_side(*(partial(second_opens_after, port, arrivals, spans)
                                      for (port, arrivals), spans in zip(timed_servers, ((), ("Maria",)))))
    gaps = {False: unmasked, True: masked}
    assert abs(gaps[True] - gaps[False]) < 300, gaps
