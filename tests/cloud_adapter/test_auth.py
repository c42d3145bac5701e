"""Authentication and TLS: every wrong way in is refused with its own status; secrets never show.

One TLS + bearer-token adapter over a tiny random model (tests/support/tiny_models.py)
serves every case; the edge is the same model behind the SLM interface.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from edge_sdk.client import Credentials, EdgeClient
from edge_sdk.protocol.channels import is_loopback
from edge_sdk.protocol.status import CloudError

from tests.support.tiny_models import bpe_tokenizer, random_qwen
from tests.support.tls_material import pem_pair

pytest.importorskip("cryptography")

TOKEN = "s3cret-token-value"
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Adapter:
    address: str
    ca_pem: bytes
    other_ca_pem: bytes
    slm: object


@pytest.fixture(scope="module")
def adapter() -> Iterator[Adapter]:
    from cloud_adapter.engine import CloudEngine
    from cloud_adapter.llm import TransformersLLM, TransformersSLM
    from cloud_adapter.inprocess import serving
    from cloud_adapter.server import TlsConfig

    tokenizer = bpe_tokenizer()
    llm = TransformersLLM.from_loaded(random_qwen(tokenizer, output_rows=448, seed=9), tokenizer, "tiny-bpe")
    ca_key, ca_cert, _, ca_pem = pem_pair("coveil test CA", None, is_ca=True)
    _, _, key_pem, cert_pem = pem_pair("coveil cloud", (ca_key, ca_cert))
    _, _, _, other_ca_pem = pem_pair("some other CA", None, is_ca=True)
    with serving(CloudEngine(llm), token=TOKEN, tls=TlsConfig(cert_pem, key_pem), max_workers=16) as adapter:
        yield Adapter(adapter.address, ca_pem, other_ca_pem, TransformersSLM(llm))


def generate(adapter: Adapter, credentials: Credentials) -> list[int]:
    with EdgeClient(adapter.address, slm=adapter.slm, credentials=credentials, max_reconnects=0,
                    timeout_s=20) as client:
        return client.generate("Which organ is affected?", "The liver is swollen.", mode="edge",
                               max_new_tokens=2).token_ids


def refused(adapter: Adapter, credentials: Credentials) -> str:
    with pytest.raises(CloudError) as caught:
        generate(adapter, credentials)
    return caught.value.code


@pytest.mark.slow
def test_the_right_token_over_verified_tls_decodes(adapter) -> None:
    assert len(generate(adapter, Credentials(token=TOKEN, root_cert=adapter.ca_pem))) == 2


def test_each_wrong_way_in_is_refused_with_its_status(adapter) -> None:
    assert refused(adapter, Credentials(root_cert=adapter.ca_pem)) == "UNAUTHENTICATED"  # no token
    assert refused(adapter, Credentials(token="wrong", root_cert=adapter.ca_pem)) == "UNAUTHENTICATED"
    assert refused(adapter, Credentials(token=TOKEN, root_cert=adapter.other_ca_pem)) == "UNAVAILABLE"  # wrong CA
    assert refused(adapter, Credentials(token=TOKEN, plaintext=True)) == "UNAVAILABLE"  # plaintext to TLS
    # no CA given: the system's trust roots, which do not know this test CA; never a plaintext fallback
    assert refused(adapter, Credentials(token=TOKEN)) == "UNAVAILABLE"


def test_an_empty_token_authenticates_nobody(adapter) -> None:
    from cloud_adapter.engine import CloudEngine
    from cloud_adapter.server import build_server
    from edge_sdk._wire import coveil_pb2, coveil_pb2_grpc

    with pytest.raises(ValueError, match="empty bearer token"):
        Credentials(token="")
    with pytest.raises(ValueError, match="empty bearer token"):
        build_server(CloudEngine(adapter.slm.llm), address="127.0.0.1:0", token=["", TOKEN])
    # a client sending "Bearer " with nothing after it
    channel = grpc.secure_channel(adapter.address, grpc.ssl_channel_credentials(adapter.ca_pem))
    stub = coveil_pb2_grpc.CollaborativeDecodingStub(channel)
    call = stub.Decode(iter([coveil_pb2.EdgeMessage(close=coveil_pb2.Close())]),
                       metadata=[("authorization", "Bearer ")], timeout=10)
    with pytest.raises(grpc.RpcError) as caught:
        list(call)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()


def test_plaintext_is_for_loopback_only() -> None:
    assert is_loopback("127.0.0.1:50051") and is_loopback("localhost:1") and is_loopback("[::1]:2")
    assert is_loopback("127.3.4.5:9") and is_loopback("unix:/tmp/coveil.sock")
    assert not is_loopback("10.0.0.5:50051") and not is_loopback("cloud.example:443") and not is_loopback("[::2]:1")
    with pytest.raises(ValueError, match="refusing plaintext"):
        Credentials(plaintext=True).channel_credentials("cloud.example:50051")


def test_secrets_never_show_in_repr() -> None:
    from cloud_adapter.server import TlsConfig

    credentials = Credentials(token=TOKEN, root_cert=b"CA", client_cert=b"CERT", client_key=b"PRIVATE KEY BYTES")
    assert TOKEN not in repr(credentials) and b"PRIVATE".decode() not in repr(credentials)
    tls = TlsConfig(b"CHAIN", b"PRIVATE KEY BYTES")
    assert "PRIVATE" not in repr(tls) and "PRIVATE" not in str(tls)


def coveil(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eval_harness.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


@pytest.mark.slow
def test_the_cli_says_what_failed_in_one_line(adapter, slm, tmp_path: Path, capsys,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from eval_harness import demo
    from eval_harness.cli.coveil import main

    monkeypatch.setattr(demo, "LlamaCppSLM", lambda *args, **kwargs: slm)  # the run's loaded edge model

    wrong = tmp_path / "token.txt"
    wrong.write_text("not-the-token\n")
    ca = tmp_path / "ca.pem"
    ca.write_bytes(adapter.ca_pem)
    common = ("demo", "--cloud", adapter.address, "--items", "1", "--max-new-tokens", "2", "--out", str(tmp_path))
    cases = [
        ((*common, "--token-file", str(wrong), "--tls-ca", str(ca)), "--token-file"),  # refused token
        ((*common,), "--tls-ca"),  # TLS adapter, system roots: the hint names the TLS flags
        ((*common, "--plaintext"), "--plaintext"),  # plaintext to a TLS adapter
        ((*common, "--token-file", str(tmp_path / "missing.txt")), "missing.txt"),  # bad file
        (("demo", "--cloud", "cloud.example:50051", "--plaintext"), "refusing plaintext"),
    ]
    # in this process (a command line's main() reads only argv; an exception it does not explain would escape
    # here and fail the test, where the process would print a traceback)
    for args, fragment in cases:
        assert main(list(args)) == 1, args
        stderr = capsys.readouterr().err
        lines = [line for line in stderr.splitlines() if line.startswith("coveil demo:")]
        assert len(lines) == 1 and fragment in lines[0], (args, stderr)
        assert "Traceback" not in stderr
    with pytest.raises(SystemExit) as bad_flag:
        main(["demo", "--modes", "sideways"])
    assert bad_flag.value.code == 2 and "modes are 'cloud' and/or 'edge'" in capsys.readouterr().err
    # with -v what failed escapes main() (the interpreter prints its traceback) ...
    with pytest.raises(CloudError, match="UNAUTHENTICATED|token"):
        main([*cases[0][0], "-v"])
    # ... as it does from the command in its own process (``python -m``), here on a file that is missing
    verbose = coveil(*cases[3][0], "-v")
    assert verbose.returncode != 0 and "Traceback" in verbose.stderr and "missing.txt" in verbose.stderr


@pytest.mark.model
def test_the_cloud_cli_says_what_failed_in_one_line(tmp_path: Path, capsys, models_loaded_once) -> None:
    import socket

    from cloud_adapter.cli import main

    # in this process over the run's loaded model: the port is found taken only after the model is loaded
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--dtype", "fp32"]) == 1
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.startswith("coveil-cloud serve:")]
    assert len(lines) == 1 and "--port" in lines[0] and "Traceback" not in stderr, stderr
    # the command in its own process, as a user runs it: a usage error, before any model is loaded
    missing = subprocess.run([sys.executable, "-m", "cloud_adapter.cli", "serve", "--token-file",
                              str(tmp_path / "nope.txt")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert missing.returncode == 2 and "nope.txt" in missing.stderr and "Traceback" not in missing.stderr
