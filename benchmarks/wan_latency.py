"""What a network round trip costs per token, with run-ahead and in lockstep (issue 21).

One run starts a cloud adapter on loopback (``coveil-cloud serve``, dtype auto, transcripts on) and a delaying
TCP proxy in front of it that holds every chunk ``RTT / 2`` in each direction.  The embedded pair decodes a few
MedPriv items (the SLM on half the cores, the adapter on the other half) in both fusion modes, with CoVeil
(lam = 1.0) and undefended fusion, at round trips of 0 (straight to the adapter: loopback), 40 and 250 ms, each
with run-ahead (``lookahead`` 8, the adapter picking its depth) and in lockstep (``lookahead=0``), interleaved
per item so load from elsewhere on the machine hits every setting alike.

Per setting:
  ms/token    = (time of the last token's event - the first's) / (tokens - 1), summed over the items: the
                steady per-token cost, the prefills left out;
  hit         = h, the share of confirmed tokens that were the cloud's draft token (its transcript);
  depth       = the rows drafted past the awaited step when a signal arrived, on average (its transcript);
  fwd/token   = the cloud's decode forwards per confirmed token (drafts included; lockstep: (n - 1) / n);
  B down/tok  = bytes the cloud sent per token (the ledger: drafted rows included);
  bound       = step + (1 - h) * (RTT + step), step = this mode and policy's lockstep ms/token on loopback:
                the expected cost when every draft the edge confirms was already there and a miss costs a
                round trip and a step.

Last lines (CoVeil): wan40_vs_loopback_edge, wan40_vs_loopback_cloud, wan250_vs_loopback_edge,
wan250_vs_loopback_cloud = run-ahead's ms/token at that round trip over run-ahead's on loopback (what the round
trip still costs; lockstep's own ratios, and run-ahead's against lockstep on loopback, are printed above them),
and cloud_forwards_per_token (run-ahead CoVeil at 40 ms, the larger of the two modes).

Usage: python benchmarks/wan_latency.py [--items 2] [--tokens 24]
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from cloud_adapter.local import local_cloud, split_cores

RTTS_MS = (0, 40, 250)
LOOKAHEAD = 8


class DelayingProxy:
    """A TCP proxy on loopback that holds every chunk ``delay_s`` in each direction (``RTT / 2``)."""

    def __init__(self, upstream: tuple[str, int], delay_s: float) -> None:
        self.upstream, self.delay_s = upstream, delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pipe(client, server)
            self._pipe(server, client)

    def _pipe(self, source: socket.socket, target: socket.socket) -> None:
        """Read ``source`` at once, write each chunk to ``target`` ``delay_s`` after it arrived (order kept)."""
        chunks: list[tuple[float, bytes]] = []
        ready = threading.Condition()

        def read() -> None:
            while True:
                try:
                    data = source.recv(65536)
                except OSError:
                    data = b""
                with ready:
                    chunks.append((time.monotonic() + self.delay_s, data))
                    ready.notify()
                if not data:
                    return

        def write() -> None:
            while True:
                with ready:
                    while not chunks:
                        ready.wait()
                    due, data = chunks.pop(0)
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                try:
                    if not data:
                        target.shutdown(socket.SHUT_WR)
                        return
                    target.sendall(data)
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()


@contextmanager
def proxied(address: str, rtt_ms: int) -> Iterator[str]:
    """``address`` itself at RTT 0, else a :class:`DelayingProxy` to it for the block."""
    if rtt_ms == 0:
        yield address
        return
    host, port = address.rsplit(":", 1)
    proxy = DelayingProxy((host, int(port)), rtt_ms / 2000)
    try:
        yield proxy.address
    finally:
        proxy.close()


@dataclass
class Setting:
    """Sums over the items of one (mode, policy, RTT, run-ahead) setting."""

    seconds: float = 0.0  # first token's event to the last's
    intervals: int = 0  # tokens - 1
    tokens: int = 0
    agreements: int = 0
    depth_sum: float = 0.0
    forwards: int = 0
    bytes_down: int = 0
    texts: list[list[int]] = field(default_factory=list)

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.seconds / max(1, self.intervals)


def read_transcript(path: Path, timeout_s: float = 10.0) -> dict:
    """The adapter's transcript of a session (written as the session ends, maybe just after the edge's last read)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=2, help="MedPriv items decoded per setting")
    parser.add_argument("--tokens", type=int, default=24, help="new tokens per generation")
    args = parser.parse_args()
    if args.items < 1 or args.tokens < 2:
        parser.error("need at least 1 item and 2 tokens")

    from tqdm import tqdm

    from edge_sdk.backends.llama_cpp import LlamaCppSLM
    from edge_sdk.client import Credentials, EdgeClient
    from edge_sdk.policies import CoVeil, Undefended
    from eval_harness.datasets import load_task

    edge_threads, cloud_threads = split_cores()
    items = load_task("medpriv", args.items)
    policies = {"coveil": CoVeil(lam=1.0), "undefended": Undefended()}
    results: dict[tuple[str, str, int, bool], Setting] = defaultdict(Setting)

    with tempfile.TemporaryDirectory(prefix="coveil-wan-") as tmp:
        transcripts = Path(tmp) / "transcripts"
        transcripts.mkdir()
        with local_cloud(Path(tmp), threads=cloud_threads, extra_args=["--transcript-dir", str(transcripts)]) as addr:
            slm = LlamaCppSLM(n_threads=edge_threads)

            def generate(client: EdgeClient, item, mode: str, policy: str, lookahead: int, into: Setting) -> None:  # noqa: ANN001
                times = []
                with client.stream(item.public_prompt, item.private_context, mode=mode, policy=policies[policy],
                                   max_new_tokens=args.tokens, lookahead=lookahead) as stream:
                    for _step in stream.steps():
                        times.append(time.perf_counter())
                    ledger, tokens = stream.ledger, stream.token_ids
                transcript = read_transcript(transcripts / f"{ledger.session_ids[-1]}.json")
                into.seconds += times[-1] - times[0]
                into.intervals += len(times) - 1
                into.tokens += len(tokens)
                into.agreements += transcript["draft_agreements"]
                into.depth_sum += transcript["mean_depth"] * len(transcript["steps"])
                into.forwards += transcript["forwards"]
                into.bytes_down += ledger.bytes_down
                into.texts.append(tokens)

            settings = [(mode, policy, rtt, ahead) for rtt in RTTS_MS for mode in ("edge", "cloud")
                        for policy in policies for ahead in (True, False)]
            with ExitStack() as stack:  # a client per round trip, each through its own proxy, all open at once
                clients = {rtt: stack.enter_context(EdgeClient(stack.enter_context(proxied(addr, rtt)), slm=slm,
                                                               credentials=Credentials(plaintext=True)))
                           for rtt in RTTS_MS}
                for client in clients.values():  # the first steps of llama.cpp and torch, each channel's connect
                    for mode in ("edge", "cloud"):
                        generate(client, items[0], mode, "coveil", LOOKAHEAD, Setting())
                # every setting once per item, the order rotating from item to item, so that load from elsewhere
                # on the machine falls on every setting alike
                for index, item in enumerate(tqdm(items, desc="items", unit="item")):
                    shift = index * 5 % len(settings)
                    for mode, policy, rtt, ahead in settings[shift:] + settings[:shift]:
                        generate(clients[rtt], item, mode, policy, LOOKAHEAD if ahead else 0,
                                 results[mode, policy, rtt, ahead])

    # -- the numbers ------------------------------------------------------------------------------------
    diverged = sum(results[m, p, r, True].texts != results[m, p, r, False].texts
                   for m, p, r, a in results if a)
    print(f"\n{args.items} MedPriv items x {args.tokens} new tokens; llama.cpp {edge_threads} thread(s), cloud torch "
          f"{cloud_threads} thread(s); run-ahead lookahead {LOOKAHEAD} (the adapter adapts its depth)")
    print(f"\n{'mode':<6}{'policy':<12}{'RTT':>5}{'run':>11}{'ms/token':>10}{'hit':>7}{'depth':>7}"
          f"{'fwd/token':>11}{'B down/tok':>12}{'bound ms':>10}")
    for mode, policy, rtt, ahead in settings:
        s = results[mode, policy, rtt, ahead]
        step = results[mode, policy, 0, False].ms_per_token
        h = s.agreements / max(1, s.tokens) if ahead else results[mode, policy, rtt, True].agreements / max(
            1, results[mode, policy, rtt, True].tokens)
        bound = step + (1 - h) * (rtt + step)
        print(f"{mode:<6}{policy:<12}{rtt:>5}{'run-ahead' if ahead else 'lockstep':>11}{s.ms_per_token:>10.1f}"
              f"{h:>7.3f}{s.depth_sum / max(1, s.tokens):>7.2f}{s.forwards / max(1, s.tokens):>11.3f}"
              f"{s.bytes_down / max(1, s.tokens):>12.0f}{bound:>10.1f}")
    print(f"\ngenerations whose tokens differ between run-ahead and lockstep: {diverged} (greedy: must be 0)")
    for rtt in RTTS_MS[1:]:
        for mode in ("edge", "cloud"):
            lock = results[mode, "coveil", rtt, False].ms_per_token / results[mode, "coveil", 0, False].ms_per_token
            print(f"lockstep at {rtt} ms, {mode}-side CoVeil: {lock:.3f}x loopback")
    for rtt in RTTS_MS:
        for mode in ("edge", "cloud"):
            ratio = results[mode, "coveil", rtt, True].ms_per_token / results[mode, "coveil", 0, False].ms_per_token
            print(f"run-ahead at {rtt} ms over lockstep on loopback, {mode}-side CoVeil: {ratio:.3f}x")
    for rtt in RTTS_MS[1:]:
        for mode in ("edge", "cloud"):
            ratio = results[mode, "coveil", rtt, True].ms_per_token / results[mode, "coveil", 0, True].ms_per_token
            print(f"wan{rtt}_vs_loopback_{mode}={ratio:.3f}")
    forwards = max(results[mode, "coveil", 40, True].forwards / max(1, results[mode, "coveil", 40, True].tokens)
                   for mode in ("edge", "cloud"))
    print(f"cloud_forwards_per_token={forwards:.3f}")


if __name__ == "__main__":
    main()
