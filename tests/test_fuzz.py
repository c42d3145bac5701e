"""Bounded fuzzing of everything that parses outside input: the adapter's messages, the dataset loader, the CLIs.

Each case must end in a proper status (a ``CloudError`` naming a gRPC
code, a ``ValueError`` naming the line, argparse's exit 2), never another
exception, and the adapter must serve a good session correctly afterwards.
"""

from __future__ import annotations

import json
import string

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloud_adapter.engine import CloudEngine
from cloud_adapter.llm import TransformersLLM
from edge_sdk.protocol import wire
from edge_sdk._wire import coveil_pb2
from edge_sdk.protocol.status import CloudError

from tests.support.tiny_models import bpe_tokenizer, random_qwen

PROMPT = "Which organ is affected? The liver, the heart or the lung."
STATUS_CODES = {code.name for code in grpc.StatusCode}


@pytest.fixture(scope="module")
def tiny_llm() -> TransformersLLM:
    tokenizer = bpe_tokenizer()
    return TransformersLLM.from_loaded(random_qwen(tokenizer, output_rows=448, seed=11), tokenizer, "tiny-bpe")


def u32(values: list[int]) -> bytes:
    return np.array(values, dtype="<u4").tobytes()


def opens(llm: TransformersLLM) -> st.SearchStrategy:
    """OpenSession messages, mostly valid-looking, each field sometimes wrong."""
    fingerprint = llm.vocab_fingerprint()
    ids = st.lists(st.integers(0, 2**32 - 1) | st.integers(0, llm.vocab_size - 1), max_size=12)
    return st.builds(
        lambda version, prompt, text, mode, space, alpha, temperature, max_new, top_m, fp, resume, stops, raw: (
            coveil_pb2.EdgeMessage(open=coveil_pb2.OpenSession(
                protocol_version=version, mode=mode, space=space, alpha=alpha, temperature=temperature,
                max_new_tokens=max_new, top_m=top_m, vocab_fingerprint=fp, vocab_size=llm.vocab_size,
                resume_prefix=coveil_pb2.TokenIds(ids=u32(resume) + raw),
                stop_token_ids=coveil_pb2.TokenIds(ids=u32(stops)),
                **({"text": text} if text is not None else {"token_ids": coveil_pb2.TokenIds(ids=u32(prompt))}),
            ))
        ),
        st.sampled_from([1, 1, 1, 0, 2]), ids, st.none() | st.text(max_size=40), st.integers(0, 3),
        st.integers(0, 3), st.floats(allow_nan=True, allow_infinity=True, width=32),
        st.floats(-1, 3, width=32) | st.just(float("nan")), st.integers(0, 2000), st.integers(0, 2**32 - 1),
        st.sampled_from([fingerprint, fingerprint, b"", b"\x00" * 32]), ids, ids, st.binary(max_size=3),
    )


def signals() -> st.SearchStrategy:
    upload = st.builds(
        lambda ids, values, dense: coveil_pb2.Upload(ids=ids, values=values, dense=dense),
        st.binary(max_size=64), st.binary(max_size=64), st.booleans(),
    )
    return st.one_of(
        st.builds(lambda step, token: coveil_pb2.EdgeMessage(signal=coveil_pb2.StepSignal(step=step, token_id=token)),
                  st.integers(0, 5), st.integers(0, 2**32 - 1)),
        st.builds(lambda step, body: coveil_pb2.EdgeMessage(signal=coveil_pb2.StepSignal(step=step, upload=body)),
                  st.integers(0, 5), upload),
        st.builds(lambda step: coveil_pb2.EdgeMessage(request_full=coveil_pb2.FullDistributionRequest(step=step)),
                  st.integers(0, 5)),
        st.just(coveil_pb2.EdgeMessage(close=coveil_pb2.Close())),
        st.just(coveil_pb2.EdgeMessage()),
        st.builds(lambda step: coveil_pb2.EdgeMessage(signal=coveil_pb2.StepSignal(step=step)), st.integers(0, 5)),
    )


@pytest.mark.slow
def test_the_adapter_answers_every_malformed_session_with_a_status(tiny_llm) -> None:
    engine = CloudEngine(tiny_llm)

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
    @given(opens(tiny_llm), st.lists(signals(), max_size=6))
    def run(open_message, rest) -> None:
        handler = engine.session("fuzz")
        try:
            for message in [open_message, *rest]:
                message = coveil_pb2.EdgeMessage.FromString(message.SerializeToString())
                list(handler.handle(message))
        except CloudError as exc:
            assert exc.code in STATUS_CODES and exc.message
        finally:
            handler.abandon("error")

    run()
    assert engine.active_sessions == 0 and engine.admission.sessions == 0
    # a good session afterwards decodes exactly what the model says
    handler = engine.session("fuzz")
    request = wire.SessionRequest(prompt_ids=tuple(tiny_llm.tokenize(PROMPT)), mode="edge", max_new_tokens=3,
                                  vocab_fingerprint=tiny_llm.vocab_fingerprint(), vocab_size=tiny_llm.vocab_size,
                                  top_m=tiny_llm.vocab_size)
    replies = list(handler.handle(wire.encode_open(request)))
    dist = wire.decode_distribution(replies[-1].distribution, tiny_llm.vocab_size)
    seq = tiny_llm.open(tiny_llm.tokenize(PROMPT))
    np.testing.assert_allclose(dist.dense, _softmax(seq.next_logits), atol=1e-6)
    handler.abandon("closed")


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z.astype(np.float64) - z.max())
    return (e / e.sum()).astype(np.float32)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(
    st.text(max_size=60),
    st.dictionaries(st.sampled_from(["_id", "public_query", "options", "private_context", "filtered_context",
                                     "answer_idx", "answer"]),
                    st.one_of(st.text(max_size=10), st.integers(), st.none(),
                              st.dictionaries(st.sampled_from("ABCD"), st.text(max_size=5))),
                    max_size=7).map(json.dumps),
), min_size=1, max_size=5))
def test_the_dataset_loader_names_the_line_of_any_bad_row(tmp_path_factory, lines) -> None:
    from eval_harness.datasets import read_jsonl

    path = tmp_path_factory.mktemp("rows") / "items.jsonl"
    path.write_text("\n".join(line.replace("\n", " ") for line in lines) + "\n")
    try:
        items = list(read_jsonl(path))
    except ValueError as exc:
        assert str(path) in str(exc) and ":" in str(exc)
    else:
        assert all(item.item_id for item in items)


ARGUMENT = st.one_of(
    st.sampled_from(["demo", "--items", "--max-new-tokens", "--modes", "--lams", "--alpha", "--cloud", "--out",
                     "--plaintext", "-v", "--tls-ca", "--token-file", "serve", "--port", "--max-sessions",
                     "--idle-timeout", "--dtype", "--exposure-k", "cloud,edge", "0", "-1", "1.5", "nan", "x",
                     "sweep", "run", "report", "--shard", "--param", "lam=1", "--policy", "--mode", "edge"]),
    st.text(alphabet=string.printable, max_size=8),
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(ARGUMENT, max_size=6))
def test_the_command_lines_parse_or_exit_with_a_usage_error(argv) -> None:
    from cloud_adapter.cli import build_parser as cloud_parser
    from eval_harness.cli.coveil import build_parser as edge_parser
    from eval_harness.cli.decodeleak import build_parser as audit_parser

    for build in (edge_parser, cloud_parser, audit_parser):
        try:
            build().parse_args(argv)
        except SystemExit as exc:
            assert exc.code in (0, 2)  # --help, or a usage error
