"""The programs in examples/ run to the end against the embedded model and print what they promise.

Each example runs as a subprocess (as a user would run it); ``custom_policy --fakes`` needs no model.  One cloud adapter on loopback,
served from the test process over the session's model, serves ``app_streaming`` and ``custom_policy`` through
``--cloud``; the TLS example starts its own adapter.
The adapter and the examples' SLM split this machine's cores (oversubscribed cores make llama.cpp and
torch spin-wait on each other).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloud_adapter.local import split_cores

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EDGE_THREADS, CLOUD_THREADS = split_cores()


def run_example(name: str, *args: str, timeout: float = 300) -> str:
    """Run ``examples/<name>`` with this interpreter; return its stdout (fail with the output on non-zero exit)."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{name} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )
    return proc.stdout


@pytest.mark.parametrize("name", ["app_streaming.py", "laptop_to_cloud_tls.py", "custom_policy.py"])
def test_example_help(name: str) -> None:
    out = run_example(name, "--help", timeout=120)
    assert "--cloud HOST:PORT" in out and "--max-new-tokens" in out
    assert "Run (from the repository root" in out  # the module docstring is the help text


@pytest.fixture(scope="module")
def cloud(engine) -> Iterator[str]:
    """The adapter over the session's model, served from this process on loopback (its torch threads capped at
    the cloud's share of the cores, as ``coveil-cloud serve --threads`` caps them)."""
    import torch

    from cloud_adapter.inprocess import serving

    before = torch.get_num_threads()
    torch.set_num_threads(CLOUD_THREADS)
    try:
        with serving(engine) as adapter:
            yield adapter.address
    finally:
        torch.set_num_threads(before)


@pytest.mark.model
def test_app_streaming(cloud: str) -> None:
    out = run_example("app_streaming.py", "--cloud", cloud, "--plaintext", "--max-new-tokens", "8",
                      "--edge-threads", str(EDGE_THREADS))
    lines = out.splitlines()
    answer = next(line for line in lines if line.startswith("A:"))
    assert len(answer) > len("A:")  # the streamed text
    assert "Privacy ledger (coveil(lam=1.0, k=50), cloud-side fusion)" in out
    header = next(line for line in lines if line.lstrip().startswith("step"))
    for column in ("token", "signal", "values up", "bytes up", "bytes down", "leak meter"):
        assert column in header
    rows = [line for line in lines if re.match(r"\s+\d+\s", line)]
    summary = re.search(r"^summary: (\d+) steps, cloud-side fusion with coveil\(lam=1\.0, k=50\): \d+ SLM values "
                        r"uploaded, .* B up / \d+ B down, leakage meter", out, re.MULTILINE)
    assert summary, out
    assert len(rows) == int(summary.group(1)) and 1 <= len(rows) <= 8
    assert all(" upload " in row for row in rows)


def test_custom_policy_is_tested_with_the_fakes_without_a_model() -> None:
    out = run_example("custom_policy.py", "--fakes", timeout=120)
    assert out.splitlines()[:3] == ["fakes step 0: token ' nerve', uploaded {' nerve': 0.60}",
                                    "fakes step 1: token ' diabetes', uploaded {}",
                                    "fakes step 2: token '.', uploaded {'.': 0.80}"]
    assert "ConfidentTop1 passed its test with the fakes" in out
    assert "registered policy" not in out  # --fakes stops before any model or cloud


@pytest.mark.model
def test_custom_policy(cloud: str) -> None:
    out = run_example("custom_policy.py", "--cloud", cloud, "--plaintext", "--max-new-tokens", "8",
                      "--edge-threads", str(EDGE_THREADS))
    assert "registered policy: confident_top1(confidence=0.5, max_gap=0.2)" in out
    summaries = re.findall(r"^  (\d+) steps, cloud-side fusion with (\w+)\(.*\): (\d+) SLM values uploaded",
                           out, re.MULTILINE)
    assert [name for _, name, _ in summaries] == ["confident_top1", "coveil"]
    steps, _, uploaded = summaries[0]
    assert int(uploaded) <= int(steps)  # at most one value per step
    assert re.search(r"^confident_top1\s+\d+\s+\d+\s+\d+\s+\d+\s+[\d.]+%$", out, re.MULTILINE)
    assert re.search(r"^coveil\s+\d+\s+\d+\s+\d+\s+\d+\s+[\d.]+%$", out, re.MULTILINE)


@pytest.mark.model
def test_laptop_to_cloud_tls() -> None:
    pytest.importorskip("cryptography", reason="the TLS example makes its certificates with `cryptography`")
    out = run_example("laptop_to_cloud_tls.py", "--max-new-tokens", "6")
    assert re.search(r"^authenticated over TLS: '.+'$", out, re.MULTILINE), out
    assert re.search(r"^ledger: \d+ steps, cloud-side fusion with coveil", out, re.MULTILINE), out
    assert "wrong token refused: UNAUTHENTICATED" in out
