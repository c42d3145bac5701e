"""Running a cloud adapter on this machine, beside the edge model (demo, examples, benchmarks, tests).

When both halves share one machine they must share its cores too: llama.cpp
and torch each default to every core, and oversubscribed cores make both spin
against each other (measured here: 32 edge-side tokens in 32-68 s with 2+2
threads on 2 cores, 2.7 s with 1+1).  :func:`split_cores` gives each half its
share and :func:`local_cloud` starts ``coveil-cloud serve`` with the cloud's,
pinned to its own cores (Linux), the calling process to the others: pinning
cut the per-step protocol overhead from ~3.9 to ~2.2 ms and the SLM's step
from 15.6 to 13.2 ms here, since no thread of one half lands on the other's core.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


def split_cores(cores: int | None = None) -> tuple[int, int]:
    """``(edge_threads, cloud_threads)`` for one machine running both halves: half each, at least one."""
    cores = cores or os.cpu_count() or 1
    cloud = max(1, cores // 2)
    return max(1, cores - cloud), cloud


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_serving(
    address: str,
    process: subprocess.Popen,
    log_path: Path,
    *,
    channel_credentials: Any = None,
    timeout_s: float = 600.0,
) -> None:
    """Poll the gRPC health service until it reports SERVING (raise if the process dies or time runs out)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    channel = (
        grpc.secure_channel(address, channel_credentials)
        if channel_credentials is not None
        else grpc.insecure_channel(address)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the cloud adapter exited during start-up:\n{log_path.read_text()[-2000:]}")
            with contextlib.suppress(grpc.RpcError):
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cloud adapter did not become healthy in {timeout_s:.0f} s; see {log_path}")
            time.sleep(0.5)


@contextlib.contextmanager
def local_cloud(
    workdir: Path,
    *,
    model: str | None = None,
    threads: int | None = None,
    pin: bool = True,
    extra_args: Sequence[str] = (),
    channel_credentials: Any = None,
    startup_timeout_s: float = 600.0,
) -> Iterator[str]:
    """Run ``coveil-cloud serve`` on a free loopback port for the duration of the block; yield its address.

    Its log goes to ``workdir/cloud.log``.  ``threads`` caps torch's threads;
    with ``pin`` (and ``threads`` below this process's core count, on Linux)
    the server runs on the last ``threads`` of this process's cores and this
    process on the rest until the block ends.  ``extra_args`` are more
    ``serve`` flags (TLS, tokens, transcripts), with ``channel_credentials``
    to health-check a TLS server.  The process is always stopped (SIGTERM,
    then SIGKILL) when the block ends.
    """
    port = free_loopback_port()
    address = f"127.0.0.1:{port}"
    command = [sys.executable, "-m", "cloud_adapter.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    if model:
        command += ["--model", model]
    if threads:
        command += ["--threads", str(threads)]
    command += list(extra_args)
    log_path = workdir / "cloud.log"
    own_cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pinned = pin and threads is not None and 0 < threads < len(own_cores)
    cloud_cores, edge_cores = (set(own_cores[-threads:]), set(own_cores[:-threads])) if pinned else (None, None)

    def pin_child() -> None:
        os.sched_setaffinity(0, cloud_cores)

    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin_child if pinned else None
        )
        try:
            if pinned:
                os.sched_setaffinity(0, edge_cores)
            wait_until_serving(
                address, process, log_path, channel_credentials=channel_credentials, timeout_s=startup_timeout_s
            )
            yield address
        finally:
            if pinned:
                os.sched_setaffinity(0, set(own_cores))
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextlib.contextmanager
def cloud_or_local(cloud: str | None, *, threads: int | None = None, **kwargs: Any) -> Iterator[str]:
    """``cloud`` itself when given, else a :func:`local_cloud` in a temporary work directory for the block."""
    if cloud:
        yield cloud
        return
    print("starting a cloud adapter on loopback ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="coveil-cloud-") as workdir:
        with local_cloud(Path(workdir), threads=threads, **kwargs) as address:
            print(f"cloud adapter ready at {address}", file=sys.stderr, flush=True)
            yield address
