"""Private-context inversion: typed to see only what the cloud saw; run against a real OpenAI-compatible server."""

from __future__ import annotations

import dataclasses
import inspect
import json
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk.privacy.meter import ExposureTrace
from eval_harness.attacks.inversion import (
    CloudObservation,
    EndpointInversion,
    InversionRefused,
    TransformersInversion,
    exposure_lines,
    inversion_cell,
    inversion_messages,
    parse_reconstruction,
    prompt_version,
    rouge1,
)
from eval_harness.llm.client import ChatClient

from tests.conftest import PRIVATE_CONTEXT, PUBLIC_PROMPT
from tests.support.http_serving import serving_in_thread
from tests.support.llama_server import llama_cpp_server

CANARY = "Quartzwhistle-7731"


@pytest.mark.slow
def test_rouge1_hand_worked() -> None:
    # rouge-score lowercases and splits on non-alphanumerics: the private context has 8 tokens
    # (the patient s liver is swollen and yellow), the reconstruction 4 (the liver is swollen), all 4 shared:
    # recall 4/8 = 0.5, precision 4/4 = 1, F1 = 2 * 0.5 * 1 / 1.5 = 2/3
    score = rouge1("the liver is swollen", "The patient's liver is swollen and yellow")
    assert score["rouge1_recall"] == pytest.approx(0.5)
    assert score["rouge1_f1"] == pytest.approx(2 / 3)


class Pieces(dict):
    """A piece reader from a table, with special ids as a vocabulary's reader has them."""

    special_ids = frozenset({1})

    def __call__(self, token_id: int) -> str:
        return self[token_id]


def test_the_attack_sees_only_what_the_cloud_observed() -> None:
    assert [f.name for f in dataclasses.fields(CloudObservation)] == ["public_query", "exposures"]
    for attack in (EndpointInversion, TransformersInversion):
        parameters = list(inspect.signature(attack.reconstruct).parameters)
        assert parameters == ["self", "observation"]
        assert inspect.get_annotations(attack.reconstruct)["observation"] == "CloudObservation"
        assert list(inspect.signature(attack.reconstruct_each).parameters) == ["self", "observations"]
        assert inspect.get_annotations(attack.reconstruct_each)["observations"] == "Sequence[CloudObservation]"
    assert parse_reconstruction("Note: The patient drinks.") == "The patient drinks."
    assert parse_reconstruction("The patient drinks.") == "The patient drinks."


PIECES = Pieces({1: "<eos>", 5: " liver", 6: " jaundice", 7: "\n", 8: " yes", 9: "liver", 10: " bile"})
OBSERVATION = CloudObservation("Which organ is affected?", ExposureTrace(3, ((5, 6, 7), (8, 6, 9), (1, 10, 5))))


def test_the_attacker_sees_every_steps_exposure_set_by_default() -> None:
    """Fails on the old prompt, which showed each step's top token and only tokens no earlier step showed."""
    # every step's top 3, best first (the newline's text is empty once stripped; <eos> is written as its text),
    # then each distinct token once in the order first seen
    assert exposure_lines(OBSERVATION, PIECES, k=3) == [
        "1: liver | jaundice", "2: yes | jaundice | liver", "3: <eos> | bile | liver",
        "Every distinct token seen:", "liver | jaundice | yes | <eos> | bile"]
    assert exposure_lines(OBSERVATION, PIECES, k=1) == [
        "1: liver", "2: yes", "3: <eos>", "Every distinct token seen:", "liver | yes | <eos>"]
    user = inversion_messages(OBSERVATION, PIECES, k=3)[-1]["content"]
    assert "2: yes | jaundice | liver\n" in user and "top 3 tokens" in user
    assert prompt_version() == prompt_version("full") != prompt_version("compact")
    with pytest.raises(ValueError, match="full, compact"):
        exposure_lines(OBSERVATION, PIECES, k=3, sequence="short")


def test_the_exposure_sequence_can_be_shown_compactly() -> None:
    # step 1: top "liver", new "jaundice" (the newline is whitespace only); step 2: top "yes", "jaundice" and
    # "liver" were shown at step 1; step 3: <eos> is special, so "bile" is its top token and "liver" is old
    assert exposure_lines(OBSERVATION, PIECES, k=3, sequence="compact") == ["1 liver | jaundice", "2 yes", "3 bile"]
    # top-2 only: step 1 (5, 6), step 2 (8, 6), step 3 (1, 10)
    assert exposure_lines(OBSERVATION, PIECES, k=2, sequence="compact") == ["1 liver | jaundice", "2 yes", "3 bile"]
    assert exposure_lines(OBSERVATION, PIECES, k=1, sequence="compact") == ["1 liver", "2 yes", "3"]
    user = inversion_messages(OBSERVATION, PIECES, k=3, sequence="compact")[-1]["content"]
    assert "Which organ is affected?" in user and "1 liver | jaundice\n2 yes\n3 bile\n" in user
    assert "top 3 " in user
    with pytest.raises(ValueError, match="larger than the cutoff"):
        exposure_lines(OBSERVATION, PIECES, k=4)


def test_a_local_attacker_refuses_a_prompt_its_context_cannot_hold() -> None:
    from types import SimpleNamespace

    attack = TransformersInversion.__new__(TransformersInversion)
    attack.piece, attack.k, attack.max_new_tokens, attack.sequence = PIECES, 3, 16, "full"
    attack.llm = SimpleNamespace(  # one token per character, a 2,000-position model
        tokenizer=SimpleNamespace(chat_template=None), tokenize=lambda text, add_bos=True: [0] * len(text),
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=2000)))
    fits = len(attack.prompt_ids(OBSERVATION))
    assert fits + 16 <= 2000
    attack.llm.model.config.max_position_embeddings = fits + 15
    with pytest.raises(ValueError, match=f"holds {fits} tokens .* more than the attacker's context of {fits + 15}"):
        attack.prompt_ids(OBSERVATION)


def test_a_local_attacker_answers_the_others_and_says_which_it_refused() -> None:
    """One observation too long for the attacker's context: it is yielded with why, the others are attacked (a
    long generation no longer ends the whole run)."""
    from types import SimpleNamespace

    attack = TransformersInversion.__new__(TransformersInversion)
    attack.piece, attack.k, attack.max_new_tokens, attack.sequence = PIECES, 3, 16, "full"
    attack.batch_size, attack.max_batch_tokens, attack.name = 4, 1 << 16, "local:stand-in"
    attack.llm = SimpleNamespace(
        tokenizer=SimpleNamespace(chat_template=None), tokenize=lambda text, add_bos=True: [0] * len(text),
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=5_000)))
    attack.complete = lambda prompts: [f"{len(p)} tokens read" for p in prompts]  # type: ignore[method-assign]
    short = CloudObservation("Which organ?", ExposureTrace(3, ((5, 6, 7),)))
    long = CloudObservation("Which organ?", ExposureTrace(3, ((5, 6, 7),) * 400))
    answers = dict(attack.reconstruct_each([long, short, short]))
    assert sorted(answers) == [0, 1, 2]
    assert isinstance(answers[0], InversionRefused) and "more than the attacker's context of 5000" in str(answers[0])
    assert answers[1] == answers[2] == f"{len(attack.prompt_ids(short))} tokens read"
    cell = inversion_cell(attack, answers[0], "the private context")
    assert cell["recall"] is None and cell["f1"] is None and cell["reconstruction"] is None
    assert cell["refused"].startswith("the inversion prompt holds")


def chat_completion(model: str, content: str) -> dict:
    """An OpenAI chat completion whose one choice says ``content``."""
    return {"id": "x", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}]}


def answer_json(handler: BaseHTTPRequestHandler, status: int, payload: dict) -> None:
    """Answer ``handler``'s request with ``payload`` as JSON."""
    data = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class ShortContextEndpoint(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint with a 2,000-byte context: a longer request gets llama.cpp's 400."""

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        body = json.loads(raw)
        if len(raw) > 2000:
            answer_json(self, 400, {"error": {"message": "the request exceeds the available context size",
                                              "type": "invalid_request_error", "code": 400}})
        else:
            answer_json(self, 200, chat_completion(body["model"], "Note: a liver."))

    def log_message(self, *args) -> None:
        pass


def test_an_endpoint_that_refuses_a_long_prompt_refuses_that_observation_only(tmp_path: Path) -> None:
    with serving_in_thread(HTTPServer(("127.0.0.1", 0), ShortContextEndpoint)) as server:
        client = ChatClient(f"http://127.0.0.1:{server.server_port}/v1", "test-model", cache_dir=tmp_path,
                            backoff_s=0.01)
        attack = EndpointInversion(client, PIECES, k=3, max_new_tokens=8, parallel=2)
        short = CloudObservation("Which organ?", ExposureTrace(3, ((5, 6, 7),)))
        long = CloudObservation("Which organ?", ExposureTrace(3, ((5, 6, 7),) * 200))
        answers = dict(attack.reconstruct_each([short, long, short]))
    assert answers[0] == answers[2] == "a liver."
    assert isinstance(answers[1], InversionRefused)
    assert "exceeds the available context size" in str(answers[1]) and "compact sequence" in str(answers[1])


def test_batches_hold_similar_lengths_within_both_limits() -> None:
    attack = TransformersInversion.__new__(TransformersInversion)
    attack.batch_size, attack.max_batch_tokens = 3, 1000
    # ascending: 100 (i4), 120 (i1), 200 (i0), 300 (i3), 400 (i2), 990 (i5); the next prompt opens a new batch
    # when the batch holds 3 or (size + 1) x its length passes 1000: [i4, i1, i0] is full (3 x 200 = 600);
    # i2 joins i3 (2 x 400 = 800); i5 would make 3 x 990 > 1000, so it stands alone
    assert attack.batches([200, 120, 400, 300, 100, 990]) == [[4, 1, 0], [3, 2], [5]]
    attack.max_batch_tokens = 50  # a prompt longer than the budget still runs, alone
    assert attack.batches([60, 70]) == [[0], [1]]


@pytest.fixture(scope="module")
def tiny_attacker() -> TransformersInversion:
    """A random 2-layer model in float64 (no near-ties for padding to flip) over the tiny byte-level vocabulary."""
    from cloud_adapter.llm import TransformersLLM
    from edge_sdk.backends.pieces import piece_reader

    from tests.support.tiny_models import bpe_tokenizer, random_qwen

    tokenizer = bpe_tokenizer()
    model = random_qwen(tokenizer, output_rows=448, seed=7, max_positions=2048).double()
    llm = TransformersLLM.from_loaded(model, tokenizer, "tiny-attacker")
    return TransformersInversion(llm, piece_reader(tokenizer), k=3, max_new_tokens=6, batch_size=4)


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(st.lists(st.lists(st.integers(2, 399), min_size=1, max_size=40), min_size=2, max_size=5))
def test_a_batched_generate_writes_what_one_prompt_at_a_time_writes(tiny_attacker, prompts) -> None:
    # ragged prompts, left-padded into one call: greedy decoding must not see the padding
    assert tiny_attacker.complete(prompts) == [tiny_attacker.complete([p])[0] for p in prompts]


@pytest.mark.slow
def test_reconstruct_each_answers_every_observation_once(tiny_attacker) -> None:
    observations = [CloudObservation(f"Which organ? {'x' * n}", ExposureTrace(3, ((5, 6, 7),) * (1 + n % 3)))
                    for n in range(6)]
    answers = dict(tiny_attacker.reconstruct_each(observations))
    assert sorted(answers) == list(range(6))
    assert [answers[i] for i in range(6)] == [tiny_attacker.reconstruct(o) for o in observations]


class FlakyEndpoint(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint that fails with 503 the first ``failures`` times."""

    failures = 2
    requests: list[dict] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FlakyEndpoint.requests.append(body)
        if len(FlakyEndpoint.requests) <= FlakyEndpoint.failures:
            self.send_response(503)
            self.end_headers()
            return
        answer_json(self, 200, chat_completion(body["model"], "Note: a swollen liver."))

    def log_message(self, *args) -> None:
        pass


def test_the_client_retries_transient_failures_and_caches_every_call(tmp_path: Path) -> None:
    with serving_in_thread(HTTPServer(("127.0.0.1", 0), FlakyEndpoint)) as server:
        client = ChatClient(f"http://127.0.0.1:{server.server_port}/v1", "test-model", cache_dir=tmp_path,
                            backoff_s=0.01)
        messages = [{"role": "user", "content": "hello"}]
        assert client.complete(messages, temperature=0.0) == "Note: a swollen liver."
        assert client.calls == 3 and len(FlakyEndpoint.requests) == 3  # two 503s, then the answer
        assert client.complete(messages, temperature=0.0) == "Note: a swollen liver."
        assert client.calls == 3  # the second time from the cache
        assert client.complete(messages, temperature=0.5) == "Note: a swollen liver."
        assert client.calls == 4  # other parameters, another request


def test_a_runs_endpoint_attacker_waits_as_long_as_inversion_timeout_says(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from eval_harness.cli.decodeleak import parse
    from eval_harness.cli.sweep import _attacker

    from tests.support.tiny_models import tiny_pair

    _, llm = tiny_pair()
    runner = SimpleNamespace(llm=llm)
    argv = ["run", "--mode", "cloud", "--policy", "undefended", "--inversion", "http://127.0.0.1:9/v1",
            "--inversion-model", "m", "--inversion-cache", str(tmp_path)]
    assert _attacker(parse(argv), runner).client.timeout_s == 120.0  # the default
    slow = _attacker(parse([*argv, "--inversion-timeout", "2400"]), runner).client
    assert slow.timeout_s == 2400.0 and slow._client.timeout == 2400.0  # the request's own limit
    with pytest.raises(SystemExit):
        parse([*argv, "--inversion-timeout", "0"])


@pytest.fixture(scope="module")
def llama_server():
    """llama-cpp-python's own OpenAI-compatible server with the embedded model, on loopback."""
    # the GGUF carries no chat template: without one the server would wrap Gemma's turns in Llama-2's
    with llama_cpp_server(chat_format="gemma") as server:
        yield server


@pytest.mark.model
def test_inversion_through_a_real_openai_compatible_server(slm, gemma_llm, llama_server, tmp_path: Path) -> None:
    from cloud_adapter.engine import CloudEngine
    from edge_sdk.client import EdgeClient
    from edge_sdk.backends.pieces import piece_reader
    from edge_sdk.policies import Undefended

    base, _ = llama_server
    engine = CloudEngine(gemma_llm)
    private = f"{PRIVATE_CONTEXT} Codename {CANARY}."
    result = EdgeClient(lambda: engine.session("tests"), slm=slm).generate(
        PUBLIC_PROMPT, private, mode="cloud", policy=Undefended(), max_new_tokens=4)
    observation = CloudObservation(PUBLIC_PROMPT, result.ledger.exposure_trace())
    client = ChatClient(base, "gemma-3-270m", cache_dir=tmp_path)
    attack = EndpointInversion(client, piece_reader(slm), k=20, max_new_tokens=48)
    reconstruction = attack.reconstruct(observation)
    assert reconstruction.strip()
    score = rouge1(reconstruction, private)
    assert 0.0 <= score["rouge1_recall"] <= 1.0 and 0.0 <= score["rouge1_f1"] <= 1.0
    # what went to the attacker is what the cloud saw: the canary's text is in no cached request
    cached = list(tmp_path.rglob("*.json"))
    assert len(cached) == 1 and CANARY not in cached[0].read_text()
    assert client.calls == 1
    again = EndpointInversion(ChatClient(base, "gemma-3-270m", cache_dir=tmp_path), piece_reader(slm), k=20,
                              max_new_tokens=48)
    assert again.reconstruct(observation) == reconstruction and again.client.calls == 0  # a re-run costs nothing


@pytest.mark.model
def test_the_local_attacker_batched_writes_what_it_writes_one_at_a_time(slm, gemma_llm) -> None:
    from edge_sdk.backends.pieces import piece_reader

    observations = [CloudObservation(PUBLIC_PROMPT, ExposureTrace(3, ((100, 200, 300), (400, 500, 600)))),
                    CloudObservation("Which drug was stopped?", ExposureTrace(2, ((7000, 9000), (1200, 800), (5,))))]
    attack = TransformersInversion(gemma_llm, piece_reader(slm), k=2, max_new_tokens=8, batch_size=2)
    together = dict(attack.reconstruct_each(observations))
    alone = [attack.reconstruct(o) for o in observations]
    assert [together[0], together[1]] == alone and all(text.strip() for text in alone)
    assert alone[0] != alone[1]  # distinct prompts, distinct answers: a swapped batch row would show


# -- the attack inside a sweep -------------------------------------------------------------------------------------

SWEEP_PRIVATE = f"The patient's liver is swollen and yellow. Codename {CANARY}."


def sweep_items() -> list:
    from eval_harness.datasets import DecodeLeakItem

    return [DecodeLeakItem(f"item-{i}", f"Which organ is affected{'?' * (1 + i)}", {"A": "heart", "B": "liver"},
                           SWEEP_PRIVATE, ("liver is swollen", CANARY), "B") for i in range(3)]


class RecordingAttacker:
    """An attacker that keeps everything it is handed and answers with a fixed text (optionally, the user
    presses Ctrl-C after ``interrupt_after`` answers)."""

    name, k, max_new_tokens, sequence = "recorder", 4, 8, "compact"

    def __init__(self, reply: str, interrupt_after: int | None = None) -> None:
        self.reply, self.interrupt_after = reply, interrupt_after
        self.handed: list[object] = []

    def reconstruct(self, observation: CloudObservation) -> str:
        return next(self.reconstruct_each([observation]))[1]

    def reconstruct_each(self, observations):
        self.handed.append(observations)
        for index in range(len(observations)):
            if self.interrupt_after is not None and index == self.interrupt_after:
                raise KeyboardInterrupt
            yield index, self.reply


def reachable(root: object) -> list[object]:
    """Every object reachable from ``root`` through containers, dataclass fields and instance attributes."""
    seen: dict[int, object] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen[id(obj)] = obj
        if isinstance(obj, dict):
            stack += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += list(obj)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            stack += [getattr(obj, f.name) for f in dataclasses.fields(obj)]
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack += list(vars(obj).values())
    return list(seen.values())


@pytest.fixture(scope="module")
def tiny_reference():
    """A tiny edge/cloud pair in the reference runner, the metrics' vocabulary, and a short protocol."""
    from cloud_adapter.llm import TransformersLLM
    from edge_sdk.backends.pieces import piece_reader
    from eval_harness.metrics import Vocabulary
    from eval_harness.decoding_protocol import DecodingProtocol
    from eval_harness.runners.reference import ReferenceRunner

    from tests.support.tiny_models import bpe_tokenizer, random_qwen

    tokenizer = bpe_tokenizer()
    slm = TransformersLLM.from_loaded(random_qwen(tokenizer, output_rows=448, seed=41, max_positions=1024),
                                      tokenizer, "tiny-edge")
    llm = TransformersLLM.from_loaded(random_qwen(tokenizer, output_rows=448, seed=42, max_positions=1024),
                                      tokenizer, "tiny-cloud")
    vocab = Vocabulary(lambda text: slm.tokenize(text, add_bos=False), piece_reader(tokenizer))
    with ReferenceRunner(slm, llm, concurrency=2) as runner:
        yield runner, vocab, DecodingProtocol(max_new_tokens=3, stop_at_answer=False)


def sweep_with(attacker, tiny_reference, out: Path):
    from eval_harness.sweep.execute import run_sweep
    from eval_harness.sweep.grid import Setting
    from eval_harness.sweep.store import ResultStore

    runner, vocab, protocol = tiny_reference
    with ResultStore(out) as store:
        return run_sweep([Setting("medpriv", "cloud", "undefended")], {"medpriv": sweep_items()}, runner, store,
                         protocol=protocol, vocab=vocab, metadata={}, inversion=attacker)


def test_a_sweep_hands_the_attacker_only_what_the_cloud_observed(tiny_reference, tmp_path: Path) -> None:
    from eval_harness.datasets import DecodeLeakItem
    from eval_harness.runners.reference import ItemRun
    from eval_harness.sweep.store import read_rows

    _, _, protocol = tiny_reference
    attacker = RecordingAttacker("the liver is swollen")
    outcome = sweep_with(attacker, tiny_reference, tmp_path / "rows.jsonl")
    assert outcome.written == 3
    (handed,) = attacker.handed  # the three items in one wave
    assert [type(o) for o in handed] == [CloudObservation] * 3
    # the item's public prompt, not the protocol's worked example before it
    assert sorted(o.public_query for o in handed) == sorted(protocol.question_prompt(i) for i in sweep_items())
    assert not any(protocol.preamble.strip() and protocol.preamble.strip() in o.public_query for o in handed)
    assert all(type(o.exposures) is ExposureTrace and o.exposures.k == attacker.k and len(o.exposures) == 3
               for o in handed)
    for obj in reachable(handed):  # nothing private anywhere in what reached the attacker
        assert not (isinstance(obj, str) and (CANARY in obj or "swollen and yellow" in obj)), obj
        assert not isinstance(obj, (dict, DecodeLeakItem, ItemRun)), type(obj)
    rows = list(read_rows([tmp_path / "rows.jsonl"]))
    # the reply's 4 unigrams all occur in the private context's 11 (the patient s liver is swollen and yellow
    # codename quartzwhistle 7731): recall 4/11, precision 1, F1 = 2 (4/11) / (1 + 4/11) = 8/15
    for row in rows:
        cell = row["inversion"]
        assert (cell["attacker"], cell["k"], cell["reconstruction"]) == ("recorder", 4, "the liver is swollen")
        assert cell["recall"] == pytest.approx(4 / 11) and cell["f1"] == pytest.approx(8 / 15)
        assert (cell["sequence"], cell["prompt"]) == ("compact", prompt_version("compact"))  # the prompt's format


def test_an_interrupted_attack_leaves_its_unwritten_items_to_the_rerun(tiny_reference, tmp_path: Path) -> None:
    from eval_harness.sweep.store import read_rows

    out = tmp_path / "rows.jsonl"
    with pytest.raises(KeyboardInterrupt):
        sweep_with(RecordingAttacker("liver", interrupt_after=1), tiny_reference, out)
    assert len(list(read_rows([out]))) == 1  # the one item scored before Ctrl-C was written at once
    again = RecordingAttacker("liver")
    outcome = sweep_with(again, tiny_reference, out)
    assert (outcome.skipped, outcome.written) == (1, 2) and len(again.handed[0]) == 2  # re-decoded, re-attacked
    rows = list(read_rows([out]))
    assert len({row["item"] for row in rows}) == 3 and all(row["inversion"]["reconstruction"] == "liver"
                                                           for row in rows)
    assert sweep_with(None, tiny_reference, tmp_path / "off.jsonl").written == 3
    assert all(row["inversion"] is None for row in read_rows([tmp_path / "off.jsonl"]))  # the attack off: null


# -- decodeleak run/sweep with the attack --------------------------------------------------------------------------

CLI = ["--limit", "2", "--max-new-tokens", "4", "--dtype", "fp32", "--concurrency", "2", "--inversion-k", "5",
       "--inversion-max-tokens", "12"]


@pytest.mark.model
def test_a_sweep_attacks_through_a_real_openai_compatible_server(llama_server, tmp_path: Path,
                                                                 models_loaded_once) -> None:
    from eval_harness.cli.decodeleak import main
    from eval_harness.datasets import load_task
    from eval_harness.sweep.store import read_rows

    base, _ = llama_server
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"alpha": 0.3, "cloud": {"undefended": {}}}))
    cache = tmp_path / "calls"
    argv = ["sweep", str(grid), "--modes", "cloud", *CLI, "--inversion", base, "--inversion-model", "gemma-3-270m",
            "--inversion-cache", str(cache)]
    assert main([*argv, "--out", str(tmp_path / "a.jsonl")]) == 0
    rows = list(read_rows([tmp_path / "a.jsonl"]))
    assert len(rows) == 2
    for row in rows:
        cell = row["inversion"]
        assert cell["attacker"] == f"gemma-3-270m @ {base}" and cell["k"] == 5 and cell["max_new_tokens"] == 12
        assert 0.0 <= cell["recall"] <= 1.0 and 0.0 <= cell["f1"] <= 1.0 and isinstance(cell["reconstruction"], str)
    requests = [path.read_text() for path in cache.rglob("*.json")]
    assert len(requests) == 2  # one call per item
    for item in load_task("medpriv", 2):  # no private context went out to the attacker
        assert all(item.private_context not in request for request in requests)
    assert main([*argv, "--out", str(tmp_path / "b.jsonl")]) == 0  # the same decoding again: all from the cache
    assert len(list(cache.rglob("*.json"))) == 2
    # rows are written as each is scored, so compare them item by item
    assert ({r["item"]: r["inversion"] for r in read_rows([tmp_path / "b.jsonl"])}
            == {r["item"]: r["inversion"] for r in rows})
    assert main(["sweep", str(grid), *CLI, "--inversion", base, "--out", str(tmp_path / "c.jsonl")]) == 1  # no model


@pytest.mark.model
def test_a_run_attacks_with_the_runs_own_cloud_model(tmp_path: Path, models_loaded_once) -> None:
    from eval_harness.cli.decodeleak import main
    from eval_harness.sweep.store import read_rows

    out = tmp_path / "run.jsonl"
    # one item (the later --limit wins): batching the local attack is its own test above
    assert main(["run", "--mode", "edge", "--policy", "undefended", "--out", str(out), *CLI, "--limit", "1",
                 "--inversion", "local"]) == 0
    rows = list(read_rows([out]))
    assert len(rows) == 1 and all(row["inversion"]["attacker"].startswith("local:gemma-3-270m") for row in rows)
