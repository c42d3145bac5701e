"""The judge: every reply validated (spans verbatim in the private context, not in the public query; invalid
JSON; wrong shape), reasons counted; build-benchmark's stages checkpointed, cached and resumable, through a
scripted OpenAI-compatible endpoint on loopback."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path

import pytest

from eval_harness.cli.decodeleak import main
from eval_harness.construction import judge as J
from eval_harness.construction.pipeline import read_stage
from eval_harness.construction.prompts import EXTRACTION_PROMPT, SCREENING_PROMPTS, load_prompt, screening_prompt
from eval_harness.construction.sources import SplitItem
from eval_harness.llm.client import ChatClient

from tests.support.construction_sources import medqa_record, shipped, write_by_split
from tests.support.openai_script import ScriptedEndpoint, extraction_reply, screening_reply, stage_of

ITEM = SplitItem(item_id="x1", split="train_jsonl", options={"A": "Borrelia", "B": "Rickettsia"}, answer_idx="A",
                 public_query="Which organism caused his fever?",
                 private_context="The patient, a 45-year-old farmer, has fever and a stiff neck after a tick bite.")


def test_spans_are_kept_only_verbatim_whole_worded_new_and_absent_from_the_public_query() -> None:
    proposed = ["45-year-old farmer", "stiff neck, tick bite", "fever", "ever", "neck after a tick",
                "45-year-old farmer", "Stiff neck", "Lyme disease", " ", "His fever"]
    kept, dropped = J.check_spans(proposed, ITEM)
    # the comma splits "stiff neck, tick bite" into two pieces, both in the context
    assert kept == ["45-year-old farmer", "stiff neck", "tick bite", "neck after a tick"]
    assert dropped == [
        {"span": "fever", "reason": J.IN_PUBLIC_QUERY},        # "his fever?" in the question
        {"span": "ever", "reason": J.CUTS_A_WORD},              # only inside "fever"
        {"span": "45-year-old farmer", "reason": J.DUPLICATE},
        {"span": "Stiff neck", "reason": J.NOT_IN_CONTEXT},     # verbatim means the same capitals
        {"span": "Lyme disease", "reason": J.NOT_IN_CONTEXT},   # the answer, not the context's words
        {"span": "", "reason": J.EMPTY_SPAN},
        {"span": "His fever", "reason": J.NOT_IN_CONTEXT},
    ]
    # a span the public query holds as whole words only, case-insensitively: "Which organism" is dropped,
    # "organ" (inside "organism") would not be, were it in the context
    item = SplitItem("x2", "s", "Which organism grows?", {"A": "a"}, "A", "An organ and which organism grow.")
    assert J.check_spans(["organ", "which organism"], item) == (
        ["organ"], [{"span": "which organism", "reason": J.IN_PUBLIC_QUERY}])


def test_a_span_an_option_holds_is_public_and_dropped() -> None:
    # the paper's x_pub is the question and its options: "tick bite" is option B's text, "Tick" a whole word of
    # it (case aside); "bite after" is not an option's run of words, "neck" is in no option
    item = SplitItem("x4", "s", "Which organism?", {"A": "Borrelia burgdorferi", "B": "tick bite"}, "A",
                     "Stiff neck after a tick bite. Tick season.")
    assert J.check_spans(["tick bite", "Tick", "neck", "a tick"], item) == (
        ["neck", "a tick"], [{"span": "tick bite", "reason": J.IN_OPTIONS}, {"span": "Tick", "reason": J.IN_OPTIONS}])


def test_a_copy_of_the_public_query_with_the_contexts_punctuation_and_spans_without_a_word_are_dropped() -> None:
    item = SplitItem("x3", "s", "Why is he short of breath? Which drug caused his cough?", {"A": "a"}, "A",
                     "He takes lisinopril. He has a dry cough; he is short of breath… (worse at night).")
    proposed = ["cough;",  # "cough" of the query, with the context's semicolon: the metrics count it as public
                "short of breath…",  # the query's words in order, punctuation aside
                ".", ";", "(", "takes lisinopril.", "dry cough"]
    kept, dropped = J.check_spans(proposed, item)
    assert kept == ["takes lisinopril.", "dry cough"]
    assert dropped == [{"span": "cough;", "reason": J.IN_PUBLIC_QUERY},
                       {"span": "short of breath…", "reason": J.IN_PUBLIC_QUERY},
                       {"span": ".", "reason": J.EMPTY_SPAN}, {"span": ";", "reason": J.EMPTY_SPAN},
                       {"span": "(", "reason": J.EMPTY_SPAN}]


def test_replies_that_are_not_an_object_of_the_schema_are_rejected_with_their_reason() -> None:
    good = json.loads(screening_reply(True))
    assert J.parse_object(json.dumps(good), J.SCREENING_SCHEMA) == good
    assert J.parse_object("```json\n" + json.dumps(good) + "\n```", J.SCREENING_SCHEMA) == good  # one fence only
    cases = [("{keep: yes}", J.INVALID_JSON, "Expecting property name"),
             (json.dumps(good)[:-1], J.INVALID_JSON, "Expecting"),
             ("Sure! " + json.dumps(good), J.INVALID_JSON, "Expecting value"),
             ("[1, 2]", J.WRONG_SHAPE, "a JSON list, not an object"),
             (json.dumps({k: v for k, v in good.items() if k != "keep"}), J.WRONG_SHAPE, "missing keep"),
             (json.dumps({**good, "confidence": 0.9}), J.WRONG_SHAPE, "unexpected confidence"),
             (json.dumps({**good, "keep": "yes"}), J.WRONG_SHAPE, 'keep must be a boolean, got "yes"')]
    for reply, reason, detail in cases:
        with pytest.raises(J.InvalidReply) as caught:
            J.parse_object(reply, J.SCREENING_SCHEMA)
        assert caught.value.reason == reason and detail in caught.value.detail, reply
    spans_not_strings = json.dumps({"evidence_spans": ["ok", 3], "rationale": ""})
    assert J.judge_extraction(spans_not_strings, ITEM).reason == J.WRONG_SHAPE


def test_screening_keeps_an_item_only_if_the_judge_keeps_it_and_it_needs_the_context() -> None:
    assert J.judge_screening(screening_reply(True)).kept
    assert J.judge_screening(screening_reply(False)).reason == J.NOT_DECISIVE
    # "keep" with "answerable without the context" contradicts the criterion: the conservative reading rejects
    assert J.judge_screening(screening_reply(True, answerable=True)).reason == J.ANSWERABLE
    assert J.judge_screening("no").reason == J.INVALID_JSON
    assert J.judge_extraction(extraction_reply(["Lyme"]), ITEM).reason == J.NO_VALID_SPAN


def test_each_json_mode_asks_in_its_endpoints_dialect() -> None:
    assert J.response_format("schema", "screening", J.SCREENING_SCHEMA) == {
        "type": "json_schema", "json_schema": {"name": "screening", "strict": True, "schema": J.SCREENING_SCHEMA}}
    grammar = J.response_format("object-schema", "evidence_spans", J.EXTRACTION_SCHEMA)
    assert grammar["type"] == "json_object"
    spans = grammar["schema"]["properties"]["evidence_spans"]
    no_control_quote_or_backslash = r'^[^"\\\x00-\x1f]{0,120}$'
    assert spans == {"type": "array", "maxItems": 16,
                     "items": {"type": "string", "pattern": no_control_quote_or_backslash}}
    assert grammar["schema"]["required"] == ["evidence_spans", "rationale"]
    pattern = re.compile(no_control_quote_or_backslash)
    assert [bool(pattern.match(text)) for text in ("a stiff neck", "line\nbreak", 'a "quote"', "x" * 121)] == [
        True, False, False, False]
    short = J.response_format("object-schema", "screening", J.SCREENING_SCHEMA, J.ReplyBounds(4, 30, 50))
    assert short["schema"]["properties"]["reason"]["pattern"].endswith("{0,50}$")
    assert J.response_format("object", "x", J.SCREENING_SCHEMA) == {"type": "json_object"}
    assert J.response_format("none", "x", J.SCREENING_SCHEMA) is None
    with pytest.raises(ValueError, match="unknown --json-mode"):
        J.response_format("grammar", "x", J.SCREENING_SCHEMA)


def test_prompt_files_are_checked_and_filled(tmp_path: Path) -> None:
    for domain in SCREENING_PROMPTS:
        system, user = screening_prompt(domain).messages(ITEM, domain)
        assert ITEM.private_context in user["content"] and ITEM.public_query in user["content"]
        assert "(A) Borrelia\n(B) Rickettsia" in user["content"] and "Correct option: (A) Borrelia" in user["content"]
        assert "$" not in system["content"] + user["content"]
    system, user = load_prompt(EXTRACTION_PROMPT).messages(ITEM, "clinical")
    assert "Domain: clinical" in system["content"]
    # without a system role: one user message, the system text first
    assert load_prompt(EXTRACTION_PROMPT).messages(ITEM, "clinical", system_role=False) == [
        {"role": "user", "content": system["content"] + "\n\n" + user["content"]}]
    bad = tmp_path / "mine.txt"
    for text, message in (("[user]\n$private_context $public_query", "needs a \\[system\\] and a \\[user\\]"),
                          ("[system]\nx\n[user]\n$private_context $public_query $patient", "unknown placeholder"),
                          ("[system]\ncosts $ 5\n[user]\n$private_context $public_query", "lone '\\$'"),
                          ("[system]\nx\n[user]\n$private_context", "never shows the judge \\$public_query"),
                          ("hello\n[system]\nx\n[user]\n$private_context", "text before the first")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_prompt(bad)
    bad.write_text("[system]\nIt costs $$5.\n[user]\n${private_context} / $public_query")
    assert screening_prompt(str(bad)).messages(ITEM, "x")[0]["content"] == "It costs $5."
    with pytest.raises(ValueError, match="neither a built-in domain"):
        screening_prompt("legal")


def test_a_rate_limited_call_waits_as_long_as_retry_after_asks(tmp_path: Path) -> None:
    def script(body: dict):
        return (429, {"Retry-After": "0.3"}) if len(endpoint.requests) == 1 else "fine"

    endpoint = ScriptedEndpoint(script)
    with endpoint.running():
        client = ChatClient(endpoint.base_url, "m", cache_dir=tmp_path, backoff_s=0.001)
        start = time.monotonic()
        assert client.complete([{"role": "user", "content": "hi"}]) == "fine"
        assert time.monotonic() - start >= 0.3 and client.calls == 2


# --- build-benchmark through a scripted endpoint -------------------------------------------------------------

def medpriv_sources(tmp_path: Path, count: int) -> tuple[list[dict], list[Path]]:
    rows = shipped("MEDPRIV.jsonl")[:count]
    return rows, write_by_split(rows, [medqa_record(r) for r in rows], tmp_path / "source")


def shared_word(row: dict) -> str:
    """A word of the public query that the private context also holds (a span copied from the public query)."""
    return next(word for word in re.findall(r"\w+", row["public_query"])
                if len(word) > 3 and re.search(rf"\b{word}\b", row["private_context"]))


def item_of(body: dict, rows: list[dict]) -> dict:
    user = body["messages"][1]["content"]
    (row,) = [r for r in rows if r["private_context"] in user and r["public_query"] in user]
    return row


def build_args(endpoint: ScriptedEndpoint, sources: list[Path], out: Path, *extra: str) -> list[str]:
    return ["build-benchmark", *map(str, sources), "--format", "medqa", "--out", str(out), "--endpoint",
            endpoint.base_url, "--model", "scripted-judge", "--cache", str(out.parent / "cache"), *extra]


def test_adversarial_replies_are_dropped_and_counted_and_a_rerun_costs_nothing(tmp_path: Path, capsys) -> None:
    rows, sources = medpriv_sources(tmp_path, 6)
    ids = [r["_id"] for r in rows]
    first_sentence = rows[0]["private_context"].split(". ")[0]

    def script(body: dict) -> str:
        row = item_of(body, rows)
        n = ids.index(row["_id"])
        if stage_of(body) == "screen":
            return {1: '{"keep": yes', 2: json.dumps({"keep": True, "reason": "short"}),
                    3: screening_reply(False)}.get(n, screening_reply(True))
        return {0: extraction_reply([first_sentence, "a stroke of bad luck",  # not in the context
                                     shared_word(row)]),  # copied from the public query
                4: "The spans are: fever",  # invalid JSON
                5: extraction_reply([shared_word(row)])}[n]

    out = tmp_path / "build"
    endpoint = ScriptedEndpoint(script)
    with endpoint.running():
        assert main(build_args(endpoint, sources, out, "--parallel", "2")) == 0
        printed = capsys.readouterr().out
        assert len(endpoint.requests) == 6 + 3  # every item screened; the three kept sent to extraction
        screen_request = next(b for b in endpoint.requests if stage_of(b) == "screen")
        assert screen_request["response_format"] == {
            "type": "json_schema", "json_schema": {"name": "screening", "strict": True, "schema": J.SCREENING_SCHEMA}}
        assert screen_request["temperature"] == 0.0 and screen_request["max_tokens"] == 512

        screening = read_stage(out / "screening.jsonl")
        assert {k: r["reason"] for k, r in screening.items()} == {
            ids[0]: J.KEPT, ids[1]: J.INVALID_JSON, ids[2]: J.WRONG_SHAPE, ids[3]: J.NOT_DECISIVE,
            ids[4]: J.KEPT, ids[5]: J.KEPT}
        extraction = read_stage(out / "extraction.jsonl")
        assert extraction[ids[0]]["spans"] == [first_sentence]
        assert [d["reason"] for d in extraction[ids[0]]["dropped"]] == [J.NOT_IN_CONTEXT, J.IN_PUBLIC_QUERY]
        assert extraction[ids[4]]["reason"] == J.INVALID_JSON
        assert extraction[ids[5]]["reason"] == J.NO_VALID_SPAN
        assert extraction[ids[5]]["dropped"] == [{"span": shared_word(rows[5]), "reason": J.IN_PUBLIC_QUERY}]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["screen"] == {"items": 6, "kept": 3, "asked_this_run": 6, "spans_kept": 0, "spans_dropped": {},
                                     "rejected": {J.INVALID_JSON: 1, J.WRONG_SHAPE: 1, J.NOT_DECISIVE: 1}}
        assert summary["extract"]["kept"] == 1 and summary["extract"]["spans_dropped"] == {
            J.NOT_IN_CONTEXT: 1, J.IN_PUBLIC_QUERY: 2}
        assert "screen: 3 kept, 3 rejected" in printed and "extract: 1 kept, 2 rejected" in printed

        # a re-run: nothing asked (the stage files hold every item), the same counts
        assert main(build_args(endpoint, sources, out)) == 0
        assert len(endpoint.requests) == 9 and json.loads((out / "summary.json").read_text())["screen"][
            "asked_this_run"] == 0
        # another model into the same directory would mix verdicts
        assert main(build_args(endpoint, sources, out)[:-4] + ["--model", "other", "--cache", str(tmp_path)]) == 1
        assert "holds a build made with other settings (model" in capsys.readouterr().err


def test_a_crash_loses_nothing_and_the_rerun_asks_only_for_what_is_missing(tmp_path: Path, capsys) -> None:
    rows, sources = medpriv_sources(tmp_path, 5)
    broken = {"on": True}

    def script(body: dict):
        row = item_of(body, rows)
        if broken["on"] and row["_id"] == rows[3]["_id"]:
            return (400, {})  # a request the endpoint refuses for good: the build stops
        if stage_of(body) == "screen":
            return screening_reply(True)
        return extraction_reply([row["private_context"].split(" ")[1]])

    out = tmp_path / "build"
    endpoint = ScriptedEndpoint(script)
    with endpoint.running():
        assert main(build_args(endpoint, sources, out, "--parallel", "1", "--max-retries", "0")) == 1
        assert "the endpoint refused a screen request (400" in capsys.readouterr().err
        # the items before the refused one were written; so was the next if it was in flight when it came
        screened = set(read_stage(out / "screening.jsonl"))
        assert {r["_id"] for r in rows[:3]} <= screened <= {r["_id"] for r in rows[:3] + rows[4:]}
        asked = len(endpoint.requests)
        broken["on"] = False
        assert main(build_args(endpoint, sources, out, "--parallel", "1")) == 0
        assert item_of(endpoint.requests[asked], rows)["_id"] == rows[3]["_id"]
        # no item was asked twice but the refused one
        screened = Counter(item_of(b, rows)["_id"] for b in endpoint.requests if stage_of(b) == "screen")
        assert screened == {**{r["_id"]: 1 for r in rows}, rows[3]["_id"]: 2}
        assert len(read_stage(out / "screening.jsonl")) == len(read_stage(out / "extraction.jsonl")) == 5


def test_bad_invocations_fail_with_one_line(tmp_path: Path, capsys) -> None:
    rows, sources = medpriv_sources(tmp_path, 1)
    common = ["--out", str(tmp_path / "b"), "--endpoint", "http://127.0.0.1:9/v1", "--model", "m"]
    for argv, message in (
            (["build-benchmark", *map(str, sources), *common], "needs --format"),
            (["build-benchmark", *map(str, sources), "--format", "generic", *common], "needs --fields"),
            (["build-benchmark", *map(str, sources), "--format", "generic", "--fields",
              "public=q,private=c,options=o,answer=a", *common], "needs --domain"),
            (["build-benchmark", *map(str, sources), "--format", "medqa", "--domain", "legal", *common],
             "no built-in screening prompt for the domain 'legal'"),
            (["build-benchmark", str(tmp_path / "nope.jsonl"), "--format", "medqa", *common], "no source file"),
            (["build-benchmark", *map(str, sources), "--format", "medqa", "--max-retries", "0", "--timeout", "2",
              *common], "cannot reach the endpoint")):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_config_file_gives_the_build_its_settings(tmp_path: Path) -> None:
    rows, sources = medpriv_sources(tmp_path, 2)
    endpoint = ScriptedEndpoint(lambda body: screening_reply(False))
    config = tmp_path / "build.json"
    out = tmp_path / "build"
    config.write_text(json.dumps({"sources": [str(s) for s in sources], "format": "medqa", "out": str(out),
                                  "endpoint": endpoint.base_url, "model": "scripted-judge", "parallel": 1,
                                  "cache": str(tmp_path / "cache"), "max-tokens": 64}))
    with endpoint.running():
        assert main(["build-benchmark", "--config", str(config)]) == 0
    assert len(endpoint.requests) == 2 and {b["max_tokens"] for b in endpoint.requests} == {64}
    assert json.loads((out / "build.json").read_text())["max_tokens"] == 64
    assert json.loads((out / "summary.json").read_text())["screen"]["rejected"] == {J.NOT_DECISIVE: 2}


@pytest.mark.slow
def test_the_disk_cache_is_keyed_by_model_and_prompt_so_a_fresh_build_costs_nothing(tmp_path: Path,
                                                                                     capsys) -> None:
    rows, sources = medpriv_sources(tmp_path, 3)
    endpoint = ScriptedEndpoint(lambda body: screening_reply(True) if stage_of(body) == "screen"
                                else extraction_reply([item_of(body, rows)["private_context"].split(" ")[1]]))
    own_prompt = tmp_path / "extract.txt"  # the shared prompt with one word more: another request
    own_prompt.write_text(EXTRACTION_PROMPT.read_text().replace("[system]\n", "[system]\nPlease.\n", 1))
    with endpoint.running():
        assert main(build_args(endpoint, sources, tmp_path / "first")) == 0
        assert len(endpoint.requests) == 3 + 3
        # another build directory (no stage file to resume from): every call comes from the cache
        assert main(build_args(endpoint, sources, tmp_path / "second")) == 0
        assert len(endpoint.requests) == 6 and "0 calls to scripted-judge" in capsys.readouterr().err
        assert read_stage(tmp_path / "second" / "extraction.jsonl") == read_stage(
            tmp_path / "first" / "extraction.jsonl")  # the same rows (written in the order they finished)
        # another extraction prompt: the screening calls are cached, the extraction calls asked again
        assert main(build_args(endpoint, sources, tmp_path / "third", "--extract-prompt", str(own_prompt))) == 0
        assert [stage_of(b) for b in endpoint.requests[6:]] == ["extract"] * 3
        assert all(b["messages"][0]["content"].startswith("Please.") for b in endpoint.requests[6:])
        # another model: nothing of the other model's is reused
        args = build_args(endpoint, sources, tmp_path / "fourth")
        args[args.index("--model") + 1] = "another-judge"
        assert main(args) == 0
        assert len(endpoint.requests) == 9 + 6 and {b["model"] for b in endpoint.requests[9:]} == {"another-judge"}


def test_requests_per_minute_spaces_the_calls_of_parallel_workers(tmp_path: Path) -> None:
    rows, sources = medpriv_sources(tmp_path, 3)
    arrivals: list[float] = []

    def script(body: dict) -> str:
        arrivals.append(time.monotonic())
        if stage_of(body) == "screen":
            return screening_reply(True)
        return extraction_reply([item_of(body, rows)["private_context"].split(" ")[1]])

    endpoint = ScriptedEndpoint(script)
    with endpoint.running():
        # 300 a minute: one start every 0.2 s, though four workers would send the three screening calls at once
        # (unlimited, the six calls take a few hundredths of a second on loopback)
        assert main(build_args(endpoint, sources, tmp_path / "build", "--parallel", "4",
                               "--requests-per-minute", "300")) == 0
    assert len(arrivals) == 6
    assert max(arrivals) - min(arrivals) >= 0.8  # five gaps of 0.2 s, less the first call's connection set-up
    with pytest.raises(SystemExit):  # argparse: "argument --requests-per-minute: must be positive, got 0.0"
        main(build_args(endpoint, sources, tmp_path / "other", "--requests-per-minute", "0"))


# --- what the build sends, and to whom ---------------------------------------------------------------------------

#: OpenAI's refusals of a reasoning model's request with the parameters of a chat model (their wording)
REASONING_REFUSALS = {
    "max_tokens": "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                  "'max_completion_tokens' instead.",
    "temperature": "Unsupported value: 'temperature' does not support 0.0 with this model. Only the default (1) "
                   "value is supported."}


def test_a_reasoning_model_can_be_the_judge(tmp_path: Path, capsys) -> None:
    """Before, every request carried max_tokens and temperature 0, which OpenAI's reasoning models (the README's
    reference judge is one) refuse with a 400, and the hint named --json-mode."""
    rows, sources = medpriv_sources(tmp_path, 2)

    def reasoning_endpoint(body: dict) -> str | tuple:
        for name, message in REASONING_REFUSALS.items():
            if name in body:
                return (400, {}, message)
        if stage_of(body) == "screen":
            return screening_reply(True)
        return extraction_reply([item_of(body, rows)["private_context"].split(" ")[1]])

    endpoint = ScriptedEndpoint(reasoning_endpoint)
    with endpoint.running():
        assert main(build_args(endpoint, sources, tmp_path / "refused", "--max-retries", "0")) == 1
        err = capsys.readouterr().err
        assert "pass --reasoning-model" in err and "--json-mode" not in err and len(err.strip().splitlines()) == 1
        asked = len(endpoint.requests)
        assert main(build_args(endpoint, sources, tmp_path / "build", "--reasoning-model", "--max-tokens", "4096")) == 0
    sent = endpoint.requests[asked:]
    assert len(sent) == 2 + 2
    assert all(body["max_completion_tokens"] == 4096 and "max_tokens" not in body and "temperature" not in body
               for body in sent)
    assert json.loads((tmp_path / "build" / "build.json").read_text())["reasoning_model"] is True
    assert json.loads((tmp_path / "build" / "summary.json").read_text())["extract"]["kept"] == 2


@pytest.mark.parametrize("body", [{"id": "x", "object": "chat.completion"}, {"choices": None}, {"choices": []},
                                  {"choices": [{"index": 0, "finish_reason": "stop"}]}])
def test_a_200_that_is_not_a_completion_stops_the_build_with_one_line(tmp_path: Path, capsys, body: dict) -> None:
    """Before, an HTTP 200 without choices crashed the build with a TypeError traceback."""
    _, sources = medpriv_sources(tmp_path, 1)
    endpoint = ScriptedEndpoint(lambda request: body)
    with endpoint.running():
        assert main(build_args(endpoint, sources, tmp_path / "build")) == 1
    err = capsys.readouterr().err
    assert "answered without a chat completion" in err and len(err.strip().splitlines()) == 1, err
    assert not list((tmp_path / "cache").glob("*/*.json"))  # nothing cached from it


def test_a_reply_of_sixty_thousand_spans_is_rejected_and_not_stored_whole(tmp_path: Path) -> None:
    """Before, a judge reply of 60,000 spans (2.5 MB) was accepted, checked span by span and stored whole."""
    rows, sources = medpriv_sources(tmp_path, 3)
    word = {row["_id"]: row["private_context"].split(" ")[1] for row in rows}
    flood = {rows[0]["_id"]: extraction_reply([f"span number {n}" for n in range(60_000)]),  # 1 MB+ of JSON
             rows[1]["_id"]: extraction_reply([word[rows[1]["_id"]]] * 300)}  # short, but 300 spans

    def script(body: dict) -> str:
        row = item_of(body, rows)
        if stage_of(body) == "screen":
            return screening_reply(True)
        return flood.get(row["_id"], extraction_reply([word[row["_id"]]]))

    endpoint = ScriptedEndpoint(script)
    with endpoint.running():
        assert main(build_args(endpoint, sources, tmp_path / "build")) == 0
    extraction = read_stage(tmp_path / "build" / "extraction.jsonl")
    assert len(flood[rows[0]["_id"]]) > 1_000_000
    assert extraction[rows[0]["_id"]]["reason"] == J.TOO_LONG and extraction[rows[0]["_id"]]["spans"] == []
    assert len(extraction[rows[0]["_id"]]["reply"]) < 70_000
    assert extraction[rows[1]["_id"]]["reason"] == J.TOO_LONG and "300 spans" in extraction[rows[1]["_id"]]["detail"]
    assert extraction[rows[2]["_id"]]["reason"] == J.KEPT
    assert (tmp_path / "build" / "extraction.jsonl").stat().st_size < 200_000


@pytest.mark.parametrize(("url", "allowed"), [
    ("https://api.openai.com/v1", True), ("http://127.0.0.1:8080/v1", True), ("http://localhost:8080/v1", True),
    ("http://[::1]:8080/v1", True), ("http://127.8.9.10/v1", True), ("http://10.0.0.7:8080/v1", False),
    ("http://judge.example.com/v1", False), ("http://localhost.example.com/v1", False), ("ftp://127.0.0.1/v1", False)])
def test_plain_http_to_another_host_is_refused_unless_asked(url: str, allowed: bool, tmp_path: Path) -> None:
    """Before, the API key and every private context went over http:// to any host without a word."""
    if allowed:
        ChatClient(url, "m", cache_dir=None)
    else:
        with pytest.raises(ValueError, match="allow-insecure-http|not an http"):
            ChatClient(url, "m", cache_dir=None)
    if url.startswith("http://") and not allowed:
        ChatClient(url, "m", cache_dir=None, allow_insecure_http=True)  # asked for: allowed


def test_the_build_and_the_sweep_refuse_plain_http_to_another_host_before_sending(tmp_path: Path, capsys) -> None:
    _, sources = medpriv_sources(tmp_path, 1)
    argv = ["build-benchmark", *map(str, sources), "--format", "medqa", "--out", str(tmp_path / "b"),
            "--endpoint", "http://judge.invalid:8080/v1", "--model", "m", "--max-retries", "0", "--timeout", "2"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "plain http to another host" in err and len(err.strip().splitlines()) == 1
    assert main([*argv, "--allow-insecure-http"]) == 1  # allowed now: it tries, and cannot reach the host
    assert "cannot reach the endpoint" in capsys.readouterr().err
    assert main(["sweep", "--tasks", "medpriv", "--limit", "1", "--out", str(tmp_path / "s.jsonl"),
                 "--inversion", "http://attacker.invalid/v1", "--inversion-model", "m"]) == 1
    assert "plain http to another host" in capsys.readouterr().err


def test_the_call_cache_is_private_bounded_and_can_be_off(tmp_path: Path) -> None:
    """Before, cached calls (each a private context and its reply) were kept forever in 0755 folders."""
    import os

    from eval_harness.llm.client import prune_cache

    endpoint = ScriptedEndpoint(lambda body: "reply to " + body["messages"][0]["content"])
    cache = tmp_path / "cache"
    (cache / "ab").mkdir(parents=True)  # a folder an older version made
    (cache / "ab").chmod(0o755)
    stale = cache / "ab" / ("ab" + "0" * 62 + ".json")
    stale.write_text(json.dumps({"reply": "stale"}))
    os.utime(stale, (time.time() - 40 * 24 * 3600,) * 2)  # 40 days old: past the 30-day bound
    with endpoint.running():
        client = ChatClient(endpoint.base_url, "m", cache_dir=cache)
        assert not stale.exists()
        assert client.complete([{"role": "user", "content": "private context"}]) == "reply to private context"
        (entry,) = cache.glob("*/*.json")
        assert entry.stat().st_mode & 0o777 == 0o600
        assert {folder.stat().st_mode & 0o777 for folder in [cache, *cache.iterdir()]} == {0o700}
        # an entry past its age is not served: asked again
        os.utime(entry, (time.time() - 31 * 24 * 3600,) * 2)
        assert client.complete([{"role": "user", "content": "private context"}]) == "reply to private context"
        assert client.calls == 2
        # off: nothing written
        off = ChatClient(endpoint.base_url, "m", cache_dir=None)
        off.complete([{"role": "user", "content": "x"}])
        off.complete([{"role": "user", "content": "x"}])
        assert off.calls == 2
    # the size bound: the oldest go first, until the rest fit (three files of 1,000 bytes, 2,500 allowed)
    for n, age in enumerate((300, 200, 100)):
        path = tmp_path / "sized" / f"{n:02d}" / f"{n:02d}.json"
        path.parent.mkdir(parents=True)
        path.write_text("x" * 1000)
        os.utime(path, (time.time() - age,) * 2)
    prune_cache(tmp_path / "sized", max_age_s=3600, max_bytes=2500)
    assert sorted(p.name for p in (tmp_path / "sized").glob("*/*.json")) == ["01.json", "02.json"]


def test_no_cache_leaves_no_call_on_disk(tmp_path: Path, monkeypatch) -> None:
    _, sources = medpriv_sources(tmp_path, 1)
    monkeypatch.setenv("COVEIL_CACHE_DIR", str(tmp_path / "home-cache"))
    endpoint = ScriptedEndpoint(lambda body: screening_reply(False))
    with endpoint.running():
        argv = ["build-benchmark", *map(str, sources), "--format", "medqa", "--endpoint", endpoint.base_url,
                "--model", "m", "--no-cache"]
        assert main([*argv, "--out", str(tmp_path / "one")]) == 0
        assert main([*argv, "--out", str(tmp_path / "two")]) == 0
    assert len(endpoint.requests) == 2 and not (tmp_path / "home-cache").exists()
