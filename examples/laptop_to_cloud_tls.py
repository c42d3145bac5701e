"""Laptop to cloud over TLS with a bearer token: the deployment shape of the SDK, on one machine.

What it does:

1. makes a throwaway certificate authority and a server certificate for ``127.0.0.1``/``localhost``
   (with the ``cryptography`` package), and a random bearer token in a token file;
2. starts the cloud adapter with them as a subprocess on a free loopback port::

       coveil-cloud serve --host 127.0.0.1 --port PORT \\
           --tls-cert server.pem --tls-key server.key --token-file tokens.txt

3. on the edge side, loads the credentials with ``Credentials.from_files(token_file=..., root_cert=...)``
   and runs one CoVeil generation through the encrypted, authenticated channel;
4. shows that a client presenting a wrong token is refused (``UNAUTHENTICATED``).

Run (from the repository root, in the project's virtual environment)::

    python examples/laptop_to_cloud_tls.py
    python examples/laptop_to_cloud_tls.py --cloud HOST:PORT --token-file tokens.txt --ca ca.pem

With ``--cloud`` no server is started: the example connects to a running adapter with the token file and
the CA certificate that signed the adapter's certificate (the host name in HOST:PORT must be one the
certificate names).  The generated key material lives in a temporary directory and is deleted at exit.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import secrets
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from cloud_adapter.local import local_cloud, split_cores
from edge_sdk.backends.llama_cpp import LlamaCppSLM
from edge_sdk.client import Credentials, EdgeClient
from edge_sdk.policies import CoVeil
from edge_sdk.protocol.status import CloudError

PRIVATE_NOTE = (
    "Visit note, 12 March: Daniel Okafor, 58, retired welder. Type 2 diabetes on metformin. Reports numbness "
    "and burning in both feet for three months, worse at night. Monofilament test: reduced sensation bilaterally."
)
PUBLIC_QUESTION = "Question: What is the most likely cause of the patient's symptoms?\nAnswer:"


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A self-signed CA and a server certificate it signed for 127.0.0.1 and localhost.

    Returns the paths of ``ca.pem`` (what the edge trusts), ``server.pem`` and ``server.key``.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    valid_from, valid_to = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "CoVeil example CA (throwaway)")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid_from)
        .not_valid_after(valid_to)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid_from)
        .not_valid_after(valid_to)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    ca_path, cert_path, key_path = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    key_path.chmod(0o600)
    return ca_path, cert_path, key_path


def write_token_file(path: Path) -> Path:
    """One random bearer token (one client identity) per line, readable by its owner only."""
    path.write_text(secrets.token_urlsafe(32) + "\n")
    path.chmod(0o600)
    return path


@contextlib.contextmanager
def tls_cloud(workdir: Path, cloud_threads: int) -> Iterator[tuple[str, Path, Path]]:
    """Start ``coveil-cloud serve`` with TLS and a token file; yield ``(address, token_file, ca_pem)``."""
    import grpc

    ca, cert, key = make_certificates(workdir)
    token_file = write_token_file(workdir / "tokens.txt")
    flags = ["--tls-cert", str(cert), "--tls-key", str(key), "--token-file", str(token_file)]
    print("starting: coveil-cloud serve " + " ".join(flags), file=sys.stderr, flush=True)
    tls = grpc.ssl_channel_credentials(ca.read_bytes())  # the health check verifies the server like a client
    with local_cloud(workdir, threads=cloud_threads, extra_args=flags, channel_credentials=tls) as address:
        print(f"cloud adapter serving TLS at {address}", file=sys.stderr, flush=True)
        yield address, token_file, ca


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cloud", metavar="HOST:PORT", help="a running TLS cloud adapter (needs --token-file, --ca)")
    parser.add_argument("--token-file", type=Path, help="bearer token file for --cloud")
    parser.add_argument("--ca", type=Path, help="PEM of the CA that signed the --cloud adapter's certificate")
    parser.add_argument("--mode", choices=["cloud", "edge"], default="cloud", help="where the distributions are fused")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--edge-threads", type=int, help="llama.cpp threads (default: all cores, or half of "
                                                         "them when the adapter runs on this machine too)")
    args = parser.parse_args(argv)
    if args.cloud and (args.token_file is None or args.ca is None):
        parser.error("--cloud needs --token-file and --ca")

    local_edge_threads, cloud_threads = split_cores()
    edge_threads = args.edge_threads or (None if args.cloud else local_edge_threads)

    with contextlib.ExitStack() as stack:
        if args.cloud:
            address, token_file, ca = args.cloud, args.token_file, args.ca
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="coveil-tls-")))
            address, token_file, ca = stack.enter_context(tls_cloud(workdir, cloud_threads))

        slm = LlamaCppSLM(n_threads=edge_threads)

        # The edge side: TLS (trusting the CA) plus the bearer token, both read from files.
        credentials = Credentials.from_files(token_file=token_file, root_cert=ca)
        with EdgeClient(address, slm=slm, credentials=credentials, timeout_s=300) as client:
            result = client.generate(PUBLIC_QUESTION, PRIVATE_NOTE, mode=args.mode, policy=CoVeil(lam=1.0),
                                     max_new_tokens=args.max_new_tokens)
        print(f"authenticated over TLS: {result.text!r}")
        print(f"ledger: {result.ledger.summary()}")

        # The same TLS channel with a token the adapter does not know: refused before any decoding.
        wrong = Credentials(token="not-the-token", root_cert=credentials.root_cert)
        with EdgeClient(address, slm=slm, credentials=wrong, timeout_s=60) as client:
            try:
                client.generate(PUBLIC_QUESTION, PRIVATE_NOTE, mode=args.mode, max_new_tokens=args.max_new_tokens)
            except CloudError as exc:
                print(f"wrong token refused: {exc.code}: {exc.message}")
            else:
                print("wrong token was NOT refused: is the adapter running without --token-file?")
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
