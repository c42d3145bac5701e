"""The deployed runner: the llama.cpp edge over gRPC against a real adapter, audited from the adapter's transcripts.

The audit must read the exposure the cloud recorded (the transcript files,
read here straight from disk), find the edge's ledger in agreement for an
honest adapter, and say so when the two differ or no transcript is there.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloud_adapter.engine import CloudEngine
from cloud_adapter.limits import Limits
from cloud_adapter.llm import TransformersLLM
from cloud_adapter.runners import StepBatcher
from cloud_adapter.inprocess import serving
from cloud_adapter.server import TlsConfig
from edge_sdk.client import GenerationResult
from edge_sdk.privacy.meter import ExposureTrace
from edge_sdk.privacy.ledger import LedgerEntry, PrivacyLedger
from edge_sdk.models import embedded_gguf_path
from edge_sdk.policies import CoVeil
from eval_harness.cli.decodeleak import main
from eval_harness.datasets import load_task
from eval_harness.metrics import Vocabulary, evidence_recall
from eval_harness.decoding_protocol import DecodingProtocol
from eval_harness.runners.audit import FROM_LEDGER, FROM_TRANSCRIPT, audit_generation
from eval_harness.runners.deployed import DeployedRunner
from eval_harness.runners.reference import ItemRun
from eval_harness.sweep.execute import result_row
from eval_harness.sweep.grid import Setting
from eval_harness.sweep.store import read_rows

from tests.support.tls_material import pem_pair

NEW_TOKENS = 8
TOKEN = "audit-token"


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """The cloud model and the llama.cpp edge share two cores here: one torch thread, or both spin."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def transcript_steps(directory: Path, session_id: str) -> list[dict]:
    return json.loads((directory / f"{session_id}.json").read_text())["steps"]


@pytest.mark.model
@pytest.mark.parametrize("mode", ["cloud", "edge"])
def test_a_local_adapter_audit_reads_what_the_cloud_recorded_and_the_ledger_agrees(
    tmp_path: Path, gemma_llm: TransformersLLM, one_torch_thread: None, mode: str
) -> None:
    protocol = DecodingProtocol(max_new_tokens=NEW_TOKENS)
    items = load_task("medpriv", 2)
    runs = [ItemRun.of(protocol, item, CoVeil(lam=1.0)) for item in items]
    transcripts = tmp_path / "transcripts"
    with DeployedRunner.with_local_adapter(gemma_llm, transcripts, concurrency=2, edge_threads=1) as runner:
        results = runner.run(runs, mode=mode, alpha=0.3, max_new_tokens=NEW_TOKENS, exposure_k=100)
        vocab = Vocabulary.from_slm(runner.policy_backend)
    setting = Setting("medpriv", mode, "coveil", {"lam": 1.0}, 0.3)
    for item, result in zip(items, results, strict=True):
        assert result.audit["exposure_source"] == FROM_TRANSCRIPT and result.audit["ledger_agrees"] is True
        assert result.audit["cloud_model"] == gemma_llm.name
        (session,) = result.ledger.session_ids  # no resume: one session, one transcript
        steps = transcript_steps(transcripts, session)
        # the trace is the cloud's record: K = 1000 there, 100 in the ledger, and the same ids at the first 100
        assert result.observed.k == 1000 and result.ledger.exposure_k == 100
        assert [list(s) for s in result.observed.steps] == [s["exposure"] for s in steps]
        assert [list(s[:100]) for s in result.observed.steps] == [list(e.exposure) for e in result.ledger.entries]
        assert [s["token_id"] for s in steps] == result.token_ids and 0 < len(steps) <= NEW_TOKENS
        if mode == "edge":  # the cloud sees its own top-K every step
            assert all(len(s["exposure"]) == 1000 for s in steps)
        row = result_row(setting, item, result, protocol=protocol, vocab=vocab, metadata={"backend": "deployed"})
        from_ledger = evidence_recall(item.evidence_spans, result.ledger.exposure_trace(), [10, 50, 100], vocab,
                                      public_query=item.public_query)
        assert {k: row["metrics"][k] for k in from_ledger} == from_ledger
        assert row["audit"]["sessions"] == [session] and "ledger_metrics" not in row


def ledger_of(exposures: list[tuple[int, ...]], tokens: list[int], sessions: list[str]) -> GenerationResult:
    ledger = PrivacyLedger("edge", "coveil", exposure_k=3, session_ids=sessions, cloud_model="cloud-x")
    for step, (exposure, token) in enumerate(zip(exposures, tokens, strict=True)):
        ledger.entries.append(LedgerEntry(step, token, "coveil", "token", 0, False, False, False, 10, 20, 0.0,
                                          1.0, 1.0, 1.0, exposure))
    return GenerationResult("text", tokens, ledger, "max_new_tokens")


def write_transcript(directory: Path, session: str, steps: list[tuple[int, int, list[int]]], k: int = 4) -> None:
    records = [{"step": t, "token_id": token, "full_requested": False, "exposure": exposure}
               for t, token, exposure in steps]
    (directory / f"{session}.json").write_text(json.dumps({"session_id": session, "exposure_k": k, "steps": records}))


def test_a_resumed_generation_is_stitched_and_a_differing_record_is_flagged(tmp_path: Path) -> None:
    result = ledger_of([(5, 6, 7), (8, 9, 10), (1, 2, 3)], [5, 11, 1], ["s1", "s2"])
    # session s1 saw steps 0-1 (step 1's ack was lost); s2 resumed at step 1 and saw it again, then step 2
    write_transcript(tmp_path, "s1", [(0, 5, [5, 6, 7, 4]), (1, 11, [8, 9, 10, 12])])
    write_transcript(tmp_path, "s2", [(1, 11, [8, 9, 10, 12]), (2, 1, [1, 2, 3, 0])])
    audited = audit_generation(result, tmp_path, wait_s=0)
    assert audited.audit == {"sessions": ["s1", "s2"], "cloud_model": "cloud-x", "exposure_source": FROM_TRANSCRIPT,
                             "transcript_k": 4, "ledger_agrees": True, "first_disagreement": None}
    assert audited.exposure_trace() == ExposureTrace(4, ((5, 6, 7, 4), (8, 9, 10, 12), (1, 2, 3, 0)))

    # an adapter that records less than the edge sent at step 2: the audit names the step
    write_transcript(tmp_path, "s2", [(1, 11, [8, 9, 10, 12]), (2, 1, [1, 2, 0, 3])])
    audited = audit_generation(result, tmp_path, wait_s=0)
    assert audited.audit["ledger_agrees"] is False and audited.audit["first_disagreement"] == 2
    # a record of a different token at step 1 disagrees there
    write_transcript(tmp_path, "s2", [(1, 12, [8, 9, 10, 12]), (2, 1, [1, 2, 3, 0])])
    assert audit_generation(result, tmp_path, wait_s=0).audit["first_disagreement"] == 1
    # a step the cloud never recorded: no trace from the transcripts, the ledger's instead, and why
    write_transcript(tmp_path, "s2", [(2, 1, [1, 2, 3, 0])])
    write_transcript(tmp_path, "s1", [(0, 5, [5, 6, 7, 4])])
    audited = audit_generation(result, tmp_path, wait_s=0)
    assert audited.audit["exposure_source"] == FROM_LEDGER and "skip steps [1]" in audited.audit["reason"]
    assert audited.exposure_trace() == result.ledger.exposure_trace()


def test_without_a_transcript_the_audit_says_it_rests_on_the_ledger(tmp_path: Path) -> None:
    result = ledger_of([(5, 6, 7)], [5], ["never-written"])
    audited = audit_generation(result, tmp_path, wait_s=0.1)
    assert audited.audit["exposure_source"] == FROM_LEDGER
    assert "no transcript never-written.json" in audited.audit["reason"]
    assert audit_generation(result, None).audit["reason"] == "no transcript directory was given"
    # a session id that would leave the directory is never turned into a path
    (tmp_path / "inner").mkdir()
    write_transcript(tmp_path, "escape", [(0, 5, [5, 6, 7])])
    audited = audit_generation(ledger_of([(5, 6, 7)], [5], ["../escape"]), tmp_path / "inner", wait_s=0)
    assert audited.audit["exposure_source"] == FROM_LEDGER and "not a plain name" in audited.audit["reason"]


@pytest.fixture
def remote_adapter(tmp_path: Path, gemma_llm: TransformersLLM, one_torch_thread: None) -> Iterator[tuple[str, Path]]:
    """An adapter as an operator runs it: TLS with its own CA, a bearer token, transcripts into a directory.

    Yields its address and the directory holding its CA (``ca.pem``), the token (``token``) and its
    transcripts (``transcripts/``).
    """
    ca_key, ca_cert, _, ca_pem = pem_pair("audit test CA", None, is_ca=True)
    _, _, key_pem, cert_pem = pem_pair("coveil cloud", (ca_key, ca_cert))
    (tmp_path / "ca.pem").write_bytes(ca_pem)
    (tmp_path / "token").write_text(TOKEN + "\n")
    with StepBatcher(gemma_llm) as batcher:
        engine = CloudEngine(gemma_llm, Limits(max_sessions=2), tmp_path / "transcripts", 100, runner=batcher)
        with serving(engine, token=TOKEN, tls=TlsConfig(cert_pem, key_pem), max_workers=8) as adapter:
            yield adapter.address, tmp_path


@pytest.mark.model
def test_a_remote_adapter_is_audited_from_its_address_and_transcript_directory(
    remote_adapter: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    address, files = remote_adapter
    command = ["run", "--runner", "deployed", "--cloud", address, "--tls-ca", str(files / "ca.pem"),
               "--token-file", str(files / "token"), "--mode", "edge", "--policy", "coveil", "--param", "lam=1",
               "--limit", "2", "--max-new-tokens", str(NEW_TOKENS), "--concurrency", "2"]
    out = files / "audited.jsonl"
    assert main([*command, "--transcripts", str(files / "transcripts"), "--out", str(out)]) == 0
    assert "2 rows from the cloud's transcripts (each agrees with the edge's ledger)" in capsys.readouterr().out
    rows = sorted(read_rows([out]), key=lambda row: row["item"])
    assert [row["item"] for row in rows] == sorted(item.item_id for item in load_task("medpriv", 2))
    gguf_sha256 = hashlib.sha256(embedded_gguf_path().read_bytes()).hexdigest()
    for row in rows:
        assert row["backend"] == "deployed" and row["adapter"]["address"] == address and row["adapter"]["tls"]
        assert row["models"]["slm"]["sha256"] == gguf_sha256 and row["protocol"]["max_new_tokens"] == NEW_TOKENS
        assert row["version"] and "SeedSequence" in row["seed_policy"] and row["params"] == {"lam": 1}
        audit = row["audit"]
        assert audit["exposure_source"] == FROM_TRANSCRIPT and audit["ledger_agrees"] and audit["transcript_k"] == 100
        (session,) = audit["sessions"]
        assert len(transcript_steps(files / "transcripts", session)) == row["tokens"]

    # the same audit without the transcripts: it says so, rests on the ledger, and (an honest adapter) agrees
    ledger_out = files / "ledger.jsonl"
    assert main([*command, "--out", str(ledger_out)]) == 0
    captured = capsys.readouterr()
    assert "no --transcripts" in captured.err and "2 from the edge's ledger alone" in captured.out
    ledger_rows = sorted(read_rows([ledger_out]), key=lambda row: row["item"])
    assert [row["audit"]["exposure_source"] for row in ledger_rows] == [FROM_LEDGER] * 2
    # the adapter recorded K = 100, the ledger K = 1000: the cutoffs both hold must agree
    assert all(int(key.split("@")[1].split(":")[0]) <= 100 for row in rows for key in row["metrics"])
    assert [{key: value for key, value in row["metrics"].items() if key in shown}
            for row, shown in zip(ledger_rows, (r["metrics"] for r in rows))] == [row["metrics"] for row in rows]
    assert [row["text"] for row in ledger_rows] == [row["text"] for row in rows]


@pytest.mark.model
def test_the_cli_starts_its_own_adapter_and_sweeps_both_modes(
    tmp_path: Path, gemma_llm: TransformersLLM, one_torch_thread: None, models_loaded_once: None
) -> None:
    # the CLI's own adapter over the weights this session already loaded (loading is not what is tested here)
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"alpha": 0.3, "cloud": {"coveil": {"lam": [1]}}, "edge": {"coveil": {"lam": [1]}}}))
    out = tmp_path / "sweep.jsonl"
    assert main(["sweep", str(grid), "--runner", "deployed", "--limit", "1", "--max-new-tokens", "4",
                 "--concurrency", "1", "--dtype", "fp32", "--out", str(out)]) == 0  # the dtype of gemma_llm
    rows = list(read_rows([out]))
    assert sorted(row["mode"] for row in rows) == ["cloud", "edge"]
    transcripts = tmp_path / "sweep.transcripts"
    for row in rows:
        assert row["adapter"]["transcripts"] == str(transcripts) and row["adapter"]["exposure_k"] == 1000
        assert row["audit"]["ledger_agrees"] and row["dtype"] == "float32"
        assert row["models"]["llm"]["name"] == gemma_llm.name
        (session,) = row["audit"]["sessions"]
        assert (transcripts / f"{session}.json").is_file()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--runner", "deployed", "--token-file", "t"], "--token-file: only for a remote adapter (--cloud)"),
        (["--cloud", "127.0.0.1:1"], "--cloud: only for --runner deployed"),
        (["--runner", "deployed", "--cloud", "10.1.2.3:50051", "--plaintext"], "refusing --plaintext to 10.1.2.3"),
        (["--runner", "deployed", "--cloud", "127.0.0.1:1", "--plaintext", "--transcripts", "/no/such/dir"],
         "the transcript directory /no/such/dir does not exist"),
        (["--runner", "deployed", "--slm", "some-org/some-model"], "--slm must be 'embedded' or a .gguf file"),
        (["--runner", "deployed", "--cloud", "127.0.0.1:1", "--llm", "other.gguf"], "a remote adapter (--cloud)"),
    ],
)
def test_bad_deployed_inputs_give_one_line(flags: list[str], message: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    command = ["run", "--mode", "edge", "--policy", "coveil", "--limit", "1", "--out", str(tmp_path / "x.jsonl")]
    assert main([*command, *flags]) == 1
    err = capsys.readouterr().err
    assert message in err and err.startswith("decodeleak run: ") and err.count("\n") == 1


@pytest.mark.model
def test_an_unreachable_adapter_is_one_line_naming_the_flag(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from cloud_adapter.local import free_loopback_port

    command = ["run", "--runner", "deployed", "--cloud", f"127.0.0.1:{free_loopback_port()}", "--plaintext",
               "--transcripts", str(tmp_path), "--mode", "edge", "--policy", "coveil", "--limit", "1",
               "--concurrency", "1", "--out", str(tmp_path / "x.jsonl")]
    assert main(command) == 1
    err = capsys.readouterr().err
    assert err.startswith("decodeleak run: cannot reach the cloud adapter: check --cloud") and err.count("\n") == 1
