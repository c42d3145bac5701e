"""The adapter's own host work per session-step, over a model that costs nothing.

The model is a null backend: its forwards return at once, with rows of a 152,064-id vocabulary (Qwen2.5's)
computed once before the run, so what the server's process spends is the engine's and the server's host work
alone: the batching worker, each session's row-to-message step, protobuf and gRPC.  The load (32 edge-side
sessions, ``cloud_adapter.loadgen``: each answers every row at once with its best id) runs in another process,
as remote edges do, so none of its Python shares the server's interpreter lock.

Two paths over the same null rows:

* ``rows``: the backend hands sessions row summaries (``StepRow``: the top ids and values, as the slot engine
  computes them on a GPU); a session step touches ``top_m + K`` numbers.
* ``rows, own drafts``: the same, with run-ahead drafts requested by each session's thread (one request to the
  batcher per draft, as before the engine drafted itself); run-ahead only;
* ``whole``: the backend hands whole float32 rows (``next_logits``, as the transformers backend does), and each
  session step computes the row's softmax and top ids over the 152,064 values in numpy (the path before the
  slot engine).

Each runs in lockstep and with run-ahead (``--lookahead``); on the ``rows`` path the batcher advances run-ahead drafts
itself (``StepBatcher(engine_drafts=True)``, the slot engine's default: each draft token read off its row as the row
is delivered, its step queued by the worker).  Measured per configuration:

* ``host_us_per_session_step`` = the server process's CPU seconds (user + system) over the run / the session-steps
  served, in microseconds;
* ``mean_batch`` = session-steps per batched forward;
* during the run-ahead load (sessions drafting without a pause), ``--probes`` new sessions open one after another
  straight through the runner; ``prefill_wait_steps`` = the step batches that ran between a probe's prefill request
  and its prefill.

For scale, the same run measures gRPC alone: a bare echo server's CPU per session-step (one message each way on
each of as many streams, no engine, no session logic; ``grpc_echo_host_us_per_session_step``), the part of the
host work that Python's gRPC costs whatever the adapter does.

Usage: python benchmarks/adapter_overhead.py [--sessions 32] [--tokens 128] [--lookahead 8] [--probes 40]
Last lines: host_us_per_session_step= (the rows path with run-ahead; target <= 100), mean_batch_32= (>= 30),
prefill_wait_steps_p99= (<= 2).
"""

from __future__ import annotations

import argparse
import resource
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from cloud_adapter.backends.rows import RowSpec, StepRow, summarize_row
from cloud_adapter.engine import CloudEngine
from cloud_adapter.inprocess import serving
from cloud_adapter.limits import Limits
from cloud_adapter.llm import CloudSequence
from cloud_adapter.loadgen import run_load_in_process
from cloud_adapter.runners import StepBatcher
from edge_sdk.models import vocab_fingerprint

#: Qwen2.5's output rows
VOCAB = 152_064
#: the id the null model ends generations with (never the top id of its rows)
EOS = 0


class NullModel:
    """A model whose forwards cost nothing: every row is one of a few precomputed ones.

    It stands in for both the :class:`~cloud_adapter.llm.TransformersLLM` the engine reads the vocabulary off
    and the model :class:`~cloud_adapter.runners.StepBatcher` runs.  With ``summarizes_rows`` its sequences carry
    :class:`StepRow` s (the slot engine's contract); without, whole ``next_logits`` rows (the transformers one's).
    """

    name = "null-152k"
    vocab_size = VOCAB
    eos_token_ids = frozenset({EOS})
    device = None

    def __init__(self, *, summarizes_rows: bool, rows: int = 4, seed: int = 0) -> None:
        self.summarizes_rows = summarizes_rows
        rng = np.random.default_rng(seed)
        self._logits = [rng.normal(scale=3.0, size=VOCAB).astype(np.float32) for _ in range(rows)]
        for logits in self._logits:
            logits[EOS] = logits.min()
        self._summaries: dict[RowSpec, list[StepRow]] = {}
        self._turn = 0
        self.steps = 0  # step batches run
        self.opened_at_step = 0  # step batches run when the latest prefill ran
        self._fingerprint = vocab_fingerprint([f"<t{i}>" for i in range(VOCAB)])

    # -- what the engine reads -------------------------------------------------------------------------
    def vocab_fingerprint(self) -> bytes:
        return self._fingerprint

    def tokenize(self, text: str) -> list[int]:
        return [1 + ord(c) % (VOCAB - 1) for c in text]

    # -- what the batcher runs -------------------------------------------------------------------------
    def _next(self, seq: CloudSequence, spec: RowSpec | None) -> None:
        self._turn = (self._turn + 1) % len(self._logits)
        if self.summarizes_rows and spec is not None:
            if spec not in self._summaries:
                self._summaries[spec] = [summarize_row(logits, spec) for logits in self._logits]
            seq.next_row, seq.next_logits = self._summaries[spec][self._turn], None
        else:
            seq.next_row, seq.next_logits = None, self._logits[self._turn]

    def open_many(self, prompts: Sequence[Sequence[int]], specs: Sequence[RowSpec | None] | None = None,
                  ) -> list[CloudSequence]:
        specs = specs if specs is not None else [None] * len(prompts)
        seqs = []
        for prompt, spec in zip(prompts, specs, strict=True):
            seq = CloudSequence(list(prompt), spec, None)
            self._next(seq, spec)
            seqs.append(seq)
        self.opened_at_step = self.steps
        return seqs

    def step(self, batch: Sequence[tuple[CloudSequence, int]]) -> None:
        self.steps += 1
        for seq, token in batch:
            seq.ids.append(int(token))
            self._next(seq, seq.cache)

    def truncate(self, seq: CloudSequence, length: int) -> None:
        del seq.ids[length:]

    def release(self, seq: CloudSequence) -> None:
        """Nothing held."""


#: the bidirectional-stream method of the bare carrier's echo server (``carrier_floor_us``)
ECHO_METHOD = "/coveil.bench.Echo/Echo"


def _echo_load(address: str, sessions: int, round_trips: int, size: int, done: Any) -> None:
    """In a process of its own: ``sessions`` streams, each ``round_trips`` times sending ``size`` bytes and waiting
    for their echo (one message each way per session-step, as a lockstep edge-side session)."""
    import queue

    import grpc

    channel = grpc.insecure_channel(address)
    echo = channel.stream_stream(ECHO_METHOD, request_serializer=None, response_deserializer=None)

    def session() -> None:
        outbox: queue.Queue[bytes | None] = queue.Queue()
        replies = echo(iter(outbox.get, None))
        for _ in range(round_trips):
            outbox.put(b"x" * size)
            next(replies)
        outbox.put(None)
        for _ in replies:
            pass

    threads = [threading.Thread(target=session) for _ in range(sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    channel.close()
    done.set()


def carrier_floor_us(args: argparse.Namespace, size: int = 200) -> float:
    """The server's CPU microseconds per session-step of gRPC alone: a bare echo stream (no engine, no session
    logic, no protobuf), ``args.sessions`` streams from another process, one ``size``-byte message each way."""
    import multiprocessing
    from concurrent import futures

    import grpc

    def echo(requests: Any, context: Any) -> Any:
        yield from requests

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=args.sessions + 16))
    handler = grpc.stream_stream_rpc_method_handler(echo)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("coveil.bench.Echo", {"Echo": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    context = multiprocessing.get_context("spawn")
    done = context.Event()
    process = context.Process(target=_echo_load, args=(f"127.0.0.1:{port}", args.sessions, args.tokens, size, done))
    before = _cpu_seconds()
    process.start()
    process.join()
    used = _cpu_seconds() - before
    server.stop(None).wait()
    if not done.is_set():
        raise RuntimeError(f"the echo load ended with exit code {process.exitcode}")
    return 1e6 * used / (args.sessions * args.tokens)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(summarizes_rows: bool, lookahead: int, args: argparse.Namespace,
            engine_drafts: bool | None = None) -> dict[str, float]:
    """One load of ``args.sessions`` sessions; probes prefills meanwhile when ``lookahead`` > 0."""
    model = NullModel(summarizes_rows=summarizes_rows)
    limits = Limits(max_sessions=args.sessions + 8, max_sessions_per_client=args.sessions + 8,
                    max_unopened_streams=args.sessions + 8, max_new_tokens=args.tokens)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, VOCAB, size=48 + i % 32).tolist() for i in range(args.sessions)]
    waits: list[int] = []
    cpu_before = 0.0
    stop = threading.Event()
    with StepBatcher(model, batch_window_ms=args.batch_window_ms,  # type: ignore[arg-type]
                     engine_drafts=engine_drafts) as batcher:
        engine = CloudEngine(model, limits, runner=batcher)  # type: ignore[arg-type]
        with serving(engine, max_workers=args.sessions + 16) as adapter:
            batcher.batch_sizes.clear()

            def probe() -> None:
                time.sleep(0.5)  # the load's sessions are decoding
                for _ in range(args.probes):
                    if stop.is_set():
                        return
                    asked = model.steps
                    seq, _ = batcher.prefill([5, 6, 7], spec=RowSpec(top_n=16))
                    waits.append(model.opened_at_step - asked)
                    batcher.release(seq)
                    time.sleep(0.02)

            prober = threading.Thread(target=probe) if lookahead and args.probes else None

            def started() -> None:
                nonlocal cpu_before
                cpu_before = _cpu_seconds()
                if prober is not None:
                    prober.start()

            report = run_load_in_process(adapter.address, prompts, started=started,
                                         fingerprint=model.vocab_fingerprint(), vocab_size=VOCAB, tokens=args.tokens,
                                         top_m=16, lookahead=lookahead)
            cpu = _cpu_seconds() - cpu_before
            stop.set()
            if prober is not None:
                prober.join()
    if report.errors:
        raise RuntimeError(f"{len(report.errors)} sessions failed: {report.errors[0]}")
    session_steps, wall = len(report.step_seconds), report.wall_seconds
    counts = batcher.batch_sizes
    batches = sum(counts.values())
    served = sum(size * n for size, n in counts.items())
    return {
        "host_us": 1e6 * cpu / max(session_steps, 1),
        "mean_batch": served / max(batches, 1),
        "tok_s": session_steps / wall,
        "wait_p99": float(np.percentile(waits, 99)) if waits else float("nan"),
        "wait_max": float(max(waits)) if waits else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=32, help="concurrent edge-side sessions")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each session decodes")
    parser.add_argument("--lookahead", type=int, default=8, help="run-ahead depth of the run-ahead configuration")
    parser.add_argument("--probes", type=int, default=40, help="prefills probed during each run-ahead load")
    parser.add_argument("--batch-window-ms", type=float, default=10.0, help="the server's batching window")
    args = parser.parse_args()

    figures: dict[tuple[str, int], dict[str, float]] = {}
    print(f"{args.sessions} edge-side sessions x {args.tokens} tokens, rows of {VOCAB:,} ids, load in another process")
    print(f"{'path':>17}{'lookahead':>10}{'host us/step':>14}{'mean batch':>12}{'tok/s':>10}{'prefill wait p99':>18}")
    runs = [("rows", True, 0, None), ("rows", True, args.lookahead, None),
            ("rows, own drafts", True, args.lookahead, False), ("whole", False, 0, None),
            ("whole", False, args.lookahead, None)]
    for path, summarizes, lookahead, engine_drafts in runs:
        got = measure(summarizes, lookahead, args, engine_drafts)
        figures[(path, lookahead)] = got
        print(f"{path:>17}{lookahead:>10}{got['host_us']:>14.1f}{got['mean_batch']:>12.2f}{got['tok_s']:>10.0f}"
              f"{got['wait_p99']:>18.1f}", flush=True)
    floor = carrier_floor_us(args)
    print(f"gRPC alone (a bare echo stream, one message each way): {floor:.1f} host us per session-step")
    rows_ahead, whole_ahead = figures[("rows", args.lookahead)], figures[("whole", args.lookahead)]
    print(f"rows_lockstep_host_us_per_session_step={figures[('rows', 0)]['host_us']:.1f}")
    own_drafts = figures[("rows, own drafts", args.lookahead)]
    print(f"own_drafts_host_us_per_session_step={own_drafts['host_us']:.1f}")
    print(f"own_drafts_mean_batch_{args.sessions}={own_drafts['mean_batch']:.2f}")
    print(f"whole_rows_host_us_per_session_step={whole_ahead['host_us']:.1f}")
    print(f"whole_vs_rows_host_work={whole_ahead['host_us'] / rows_ahead['host_us']:.2f}")
    print(f"grpc_echo_host_us_per_session_step={floor:.1f}")
    print(f"host_us_per_session_step={rows_ahead['host_us']:.1f}")
    print(f"mean_batch_{args.sessions}={rows_ahead['mean_batch']:.2f}")
    print(f"prefill_wait_steps_p99={rows_ahead['wait_p99']:.1f}")


if __name__ == "__main__":
    main()
