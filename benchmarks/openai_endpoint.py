"""The endpoint's cost: the same generations through the OpenAI endpoint (the ``openai`` client, streaming), its
Ollama route (the ``ollama`` client, streaming ``/api/chat``), its Anthropic route (the ``anthropic`` client,
streaming ``/v1/messages``), its Responses route (the ``openai`` client's ``responses``, streaming) and
``EdgeClient`` directly, in one run; and embeddings through ``/v1/embeddings`` against llama.cpp's own.

One run starts a cloud adapter on loopback (``coveil-cloud serve``, dtype auto, its share of the cores), loads the
SLM once and serves the endpoint in this process (uvicorn on a thread) over the *same* ``EdgeClient``.  Each round
decodes the same MedPriv items the three ways (every item one way, then every item the next, the order rotating
between rounds so each path goes first as often; with ``--items`` >= 2 no prompt follows itself, so no generation
is served its prefill from the SLM's cache of the one before), CoVeil (lam = 1.0), greedy, so the paths decide
the same tokens (checked: ``text_mismatches``, over both routes).  The direct path does what the endpoint does
for a chat request: render the conversation with the model's chat template (``chat_prompts``), then stream.

Per generation, timed in the caller from the call to the last token:
  ttft        = time to the first non-empty text (direct: the first piece ``client.stream`` yields; endpoint:
                the first chunk with content, through HTTP, SSE and the openai client; ollama: the first NDJSON
                line with content, through the ollama client);
  tokens/s    = tokens decided / (time to the last token), the rate an app sees.
Headline figures, medians over all generations of each path:
  endpoint_vs_sdk  = endpoint tokens/s / direct tokens/s                    (target >= 0.95)
  ollama_vs_sdk    = ollama route tokens/s / direct tokens/s                (target >= 0.95)
  messages_vs_sdk  = /v1/messages tokens/s / direct tokens/s                (target >= 0.95)
  responses_vs_sdk = /v1/responses tokens/s / direct tokens/s               (target >= 0.95)
  ttft_overhead_ms = endpoint ttft - direct ttft, in milliseconds         (target <= 50)
  (ollama_ttft_overhead_ms the same for the Ollama route.)
JSON-schema decoding in edge-side fusion (where the grammar's per-step cost falls on the device; cloud-side the
adapter masks where it picks and the edge only advances its copy of the grammar), through ``EdgeClient`` directly:
the same items decoded free and under a small schema (every item one way, then the other, rotating), each
generation's time per step = its time / its tokens;
  json_schema_step_overhead = median ms/step under the schema / median ms/step free - 1      (target <= 0.05)
  tool_call_step_overhead   = the same under two tools' call grammar (``tool_choice: "auto"``)  (target <= 0.05)
  (the mask, its renormalisation, the grammar's advance, and the full rows the cloud sends under a schema).
Concurrency (the endpoint's queue: one SLM, one generation at a time, FIFO): ``--concurrency`` requests sent at
once; queue_aggregate_vs_sequential = their tokens / wall time over the sequential endpoint tokens/s (about 1:
a queue serves the SLM's rate, never more), queue_max_wait_ms the longest ``coveil.queue_ms`` among them.

Embeddings (no cloud at all): ``--embed-texts`` sentences of the items (cycled), in batches of ``--embed-batch``,
embedded through ``/v1/embeddings`` (the ``openai`` client, base64 as it asks by default) and by a llama.cpp
context over the same GGUF (mean pooling, normalised, the same threads), alternating rounds;
  embeddings_per_s = endpoint texts/s / llama.cpp texts/s                 (target >= 0.9)

Usage: python benchmarks/openai_endpoint.py [--items 3] [--tokens 32] [--rounds 3] [--mode cloud|edge]
                                            [--concurrency 4] [--embed-batch 16] [--embed-texts 64]
The last lines are embeddings_per_s, endpoint_vs_sdk, ollama_vs_sdk, messages_vs_sdk, responses_vs_sdk,
json_schema_step_overhead, tool_call_step_overhead and ttft_overhead_ms.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path


#: the schema of the JSON-schema runs: a short answer object (what an app asking for structure sends)
JSON_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40},
                                                "confident": {"type": "boolean"}},
               "required": ["answer", "confident"], "additionalProperties": False}
#: the tools of the tool-call runs: two functions, as an agent offers them
TOOLS = [{"type": "function", "function": {"name": "lookup_condition", "description": "Facts about a condition",
                                           "parameters": {"type": "object", "properties": {
                                               "condition": {"type": "string", "maxLength": 40}},
                                               "required": ["condition"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "organ_info", "description": "Facts about an organ",
                                           "parameters": {"type": "object", "properties": {
                                               "organ": {"enum": ["liver", "heart", "lung", "kidney"]}},
                                               "required": ["organ"], "additionalProperties": False}}}]


@dataclass(frozen=True)
class Timing:
    ttft_s: float
    total_s: float
    tokens: int
    text: str

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=3, help="MedPriv items decoded per round")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per generation")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the items, each path once per item")
    parser.add_argument("--mode", choices=["cloud", "edge"], default="cloud", help="fusion mode")
    parser.add_argument("--concurrency", type=int, default=4, help="requests sent at once for the queue figure")
    parser.add_argument("--embed-batch", type=int, default=16, help="texts per embeddings request")
    parser.add_argument("--embed-texts", type=int, default=64,
                        help="texts embedded per round (the items' sentences, cycled)")
    args = parser.parse_args()
    if min(args.tokens, args.rounds, args.concurrency) < 1 or args.items < 2:
        parser.error("--tokens, --rounds and --concurrency must be at least 1, --items at least 2")

    import llama_cpp
    from anthropic import Anthropic
    from ollama import Client as OllamaClient
    from openai import OpenAI
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from cloud_adapter.local import local_cloud, split_cores
    from edge_sdk.backends.chat_template import LlamaCppChatTemplate
    from edge_sdk.backends.llama_cpp import LlamaCppSLM
    from edge_sdk.client import Credentials, EdgeClient
    from edge_sdk.policies import CoVeil
    from edge_sdk.prompts import chat_prompts
    from edge_sdk.server.app import create_app, running
    from edge_sdk.server.serving import StopStrings, StopText
    from edge_sdk.server.settings import ServerSettings
    from edge_sdk.server.tools import Tool, reply_schema
    from eval_harness.datasets import load_task

    console = Console(stderr=True)
    items = load_task("medpriv", args.items)
    edge_threads, cloud_threads = split_cores()
    with tempfile.TemporaryDirectory(prefix="coveil-bench-") as tmp, \
            local_cloud(Path(tmp), threads=cloud_threads) as address:
        slm = LlamaCppSLM(n_threads=edge_threads, n_ctx=4096)
        template = LlamaCppChatTemplate.for_model(slm)
        client = EdgeClient(address, slm=slm, credentials=Credentials(plaintext=True))
        settings = ServerSettings(cloud=address, plaintext=True, n_ctx=slm.n_ctx, max_queue=args.concurrency,
                                  threads=edge_threads)
        app = create_app(settings, client=client, chat_template=template, n_ctx=slm.n_ctx)

        def direct(item) -> Timing:  # noqa: ANN001
            start = time.perf_counter()
            prompts = chat_prompts(template, [{"role": "user", "content": item.public_prompt}], item.private_context)
            # ending where the endpoint ends it: at the prompt format's stop (a completion-style prompt's next
            # question), the text before it shown
            stops = StopStrings(template.stops) if template.stops else None
            stream = client.stream(prompts, mode=args.mode, policy=CoVeil(lam=1.0), max_new_tokens=args.tokens,
                                   stopping=stops)
            first, pieces, shown = None, [], StopText(template.stops)
            for piece in map(shown.feed, stream):
                if piece:  # as the endpoint's clock below: the first piece with text
                    first = first or time.perf_counter()
                pieces.append(piece)
            pieces.append(shown.flush())
            end = time.perf_counter()
            return Timing((first or end) - start, end - start, len(stream.token_ids), "".join(pieces))

        with running(app) as base_url:
            api = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)

            def request(item) -> tuple[Timing, float]:  # noqa: ANN001
                start = time.perf_counter()
                chunks = api.chat.completions.create(
                    model="coveil", messages=[{"role": "user", "content": item.public_prompt}], stream=True,
                    max_tokens=args.tokens, extra_body={"coveil": {"private_context": item.private_context,
                                                                   "mode": args.mode, "params": {"lam": 1.0}}})
                first, pieces, steps, queue_ms = None, [], 0, 0.0
                for chunk in chunks:
                    extension = chunk.model_extra.get("coveil") or {}
                    steps += extension.get("step") is not None
                    queue_ms = (extension.get("ledger") or {}).get("queue_ms", queue_ms)
                    text = chunk.choices[0].delta.content if chunk.choices else None
                    if text:
                        first = first or time.perf_counter()
                        pieces.append(text)
                end = time.perf_counter()
                return Timing((first or end) - start, end - start, steps, "".join(pieces)), queue_ms

            ollama_api = OllamaClient(host=base_url, timeout=600)

            def ollama_request(item) -> Timing:  # noqa: ANN001
                start = time.perf_counter()
                parts = ollama_api.chat(
                    model="coveil", messages=[{"role": "user", "content": item.public_prompt}], stream=True,
                    options={"num_predict": args.tokens, "coveil": {"private_context": item.private_context,
                                                                    "mode": args.mode, "params": {"lam": 1.0}}})
                first, pieces, steps = None, [], 0
                for part in parts:
                    if part.message.content:
                        first = first or time.perf_counter()
                        pieces.append(part.message.content)
                    steps = part.eval_count or steps  # on the last line
                end = time.perf_counter()
                return Timing((first or end) - start, end - start, steps, "".join(pieces))

            anthropic_api = Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=600)

            def messages_request(item) -> Timing:  # noqa: ANN001
                start = time.perf_counter()
                first, pieces = None, []
                with anthropic_api.messages.stream(
                        model="coveil", max_tokens=args.tokens,
                        messages=[{"role": "user", "content": item.public_prompt}],
                        extra_body={"coveil": {"private_context": item.private_context, "mode": args.mode,
                                               "params": {"lam": 1.0}}}) as stream:
                    for text in stream.text_stream:
                        if text:
                            first = first or time.perf_counter()
                            pieces.append(text)
                    steps = stream.get_final_message().usage.output_tokens
                end = time.perf_counter()
                return Timing((first or end) - start, end - start, steps, "".join(pieces))

            def responses_request(item) -> Timing:  # noqa: ANN001
                start = time.perf_counter()
                events = api.responses.create(
                    model="coveil", input=item.public_prompt, max_output_tokens=args.tokens, stream=True,
                    extra_body={"coveil": {"private_context": item.private_context, "mode": args.mode,
                                           "params": {"lam": 1.0}}})
                first, pieces, steps = None, [], 0
                for event in events:
                    if event.type == "response.output_text.delta" and event.delta:
                        first = first or time.perf_counter()
                        pieces.append(event.delta)
                    elif event.type in ("response.completed", "response.incomplete"):
                        steps = event.response.usage.output_tokens
                end = time.perf_counter()
                return Timing((first or end) - start, end - start, steps, "".join(pieces))

            paths = {"direct": direct, "endpoint": lambda item: request(item)[0], "ollama": ollama_request,
                     "messages": messages_request, "responses": responses_request}
            for path in paths.values():  # warm-up: model pages, the adapter's first session, the HTTP stack
                path(items[-1])  # (the last item, so the first timed generation does not follow its own prompt)
            runs: dict[str, list[Timing]] = {name: [] for name in paths}
            names = list(paths)
            with Progress(console=console, transient=True) as progress:
                task = progress.add_task("generations", total=len(paths) * args.rounds * len(items))
                for round_index in range(args.rounds):
                    # every item through one path, then through the next: the same prompt never runs twice in
                    # a row, so no path is served another's prefill from the SLM's cache; the order rotates
                    shift = round_index % len(names)
                    for path in names[shift:] + names[:shift]:
                        for item in items:
                            runs[path].append(paths[path](item))
                            progress.advance(task)
            mismatches = sum(d.text != e.text for route in names[1:]
                             for d, e in zip(runs["direct"], runs[route], strict=True))

            # embeddings: the endpoint against llama.cpp's own over the same GGUF, threads and texts
            sentences = [sentence.strip() for item in items
                         for sentence in re.split(r"(?<=[.!?])\s+|\n", item.private_context + "\n" + item.public_prompt)
                         if sentence.strip()]
            texts = [sentences[i % len(sentences)] for i in range(max(args.embed_texts, len(sentences)))]
            batches = [texts[i : i + args.embed_batch] for i in range(0, len(texts), args.embed_batch)]
            raw = llama_cpp.Llama(model_path=str(slm.source.gguf_path), embedding=True,
                                  pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, n_ctx=slm.n_ctx,
                                  n_batch=slm.n_ctx, n_ubatch=slm.n_ctx, n_threads=edge_threads,
                                  n_threads_batch=edge_threads, verbose=False)

            def embed_raw() -> float:
                start = time.perf_counter()
                for batch in batches:
                    raw.embed(batch, normalize=True)
                return len(texts) / (time.perf_counter() - start)

            def embed_endpoint() -> float:
                start = time.perf_counter()
                for batch in batches:
                    api.embeddings.create(model="coveil", input=batch)
                return len(texts) / (time.perf_counter() - start)

            embed_raw(), embed_endpoint()  # warm-up: the endpoint loads its embedding context on first use
            embed_rates: dict[str, list[float]] = {"raw": [], "endpoint": []}
            for round_index in range(args.rounds):
                order = ("raw", "endpoint") if round_index % 2 == 0 else ("endpoint", "raw")
                for way in order:
                    embed_rates[way].append(embed_raw() if way == "raw" else embed_endpoint())
            raw.close()

            # JSON-schema decoding against free decoding, edge-side, direct
            def edge_step_ms(item, schema) -> float:  # noqa: ANN001
                prompts = chat_prompts(template, [{"role": "user", "content": item.public_prompt}],
                                       item.private_context)
                start = time.perf_counter()
                result = client.generate(prompts, mode="edge", policy=CoVeil(lam=1.0), max_new_tokens=args.tokens,
                                         json_schema=schema)
                return 1e3 * (time.perf_counter() - start) / max(1, len(result.token_ids))

            edge_step_ms(items[-1], JSON_SCHEMA)  # warm-up: the grammar engine's tokenizer is built once per model
            tools_schema = reply_schema([Tool.model_validate(tool) for tool in TOOLS], text_allowed=True)
            edge_step_ms(items[-1], tools_schema)
            schema_runs: dict[str, list[float]] = {"free": [], "schema": [], "tools": []}
            schemas = {"free": None, "schema": JSON_SCHEMA, "tools": tools_schema}
            ways = list(schemas)
            with Progress(console=console, transient=True) as progress:
                task = progress.add_task("json schema", total=len(ways) * args.rounds * len(items))
                for round_index in range(args.rounds):
                    shift = round_index % len(ways)
                    for way in ways[shift:] + ways[:shift]:
                        for item in items:
                            schema_runs[way].append(edge_step_ms(item, schemas[way]))
                            progress.advance(task)

            # the queue: requests at once, against the sequential endpoint rate
            results: list[tuple[Timing, float]] = []
            lock = threading.Lock()

            def concurrent(item) -> None:  # noqa: ANN001
                outcome = request(item)
                with lock:
                    results.append(outcome)

            started = time.perf_counter()
            threads = [threading.Thread(target=concurrent, args=(items[i % len(items)],))
                       for i in range(args.concurrency)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            wall = time.perf_counter() - started
        client.close()

    def median(values: list[float]) -> float:
        return statistics.median(values)

    table = Table(title=f"{args.mode}-side CoVeil, {len(items)} MedPriv items x {args.rounds} rounds, "
                        f"{args.tokens} tokens, edge {edge_threads} / cloud {cloud_threads} threads")
    for column in ("path", "tokens/s (median)", "tokens/s (min..max)", "ttft ms (median)", "ttft ms (min..max)"):
        table.add_column(column, justify="right")
    for path, timings in runs.items():
        rates = [t.tokens_per_s for t in timings]
        ttfts = [1e3 * t.ttft_s for t in timings]
        table.add_row(path, f"{median(rates):.2f}", f"{min(rates):.2f}..{max(rates):.2f}", f"{median(ttfts):.1f}",
                      f"{min(ttfts):.1f}..{max(ttfts):.1f}")
    console.print(table)
    console.print(f"edge-side CoVeil through EdgeClient, ms/step (median): free {median(schema_runs['free']):.1f}, "
                  f"under the JSON schema {median(schema_runs['schema']):.1f}, under the tools' grammar "
                  f"{median(schema_runs['tools']):.1f}")

    def rate(path: str) -> float:
        return median([t.tokens_per_s for t in runs[path]])

    def ttft_overhead_ms(path: str) -> float:
        return 1e3 * (median([t.ttft_s for t in runs[path]]) - median([t.ttft_s for t in runs["direct"]]))

    aggregate = sum(t.tokens for t, _ in results) / wall
    console.print(f"embeddings, texts/s (median of {args.rounds}): llama.cpp {median(embed_rates['raw']):.1f}, "
                  f"endpoint {median(embed_rates['endpoint']):.1f} ({len(texts)} texts in batches of "
                  f"{args.embed_batch})")
    print(f"text_mismatches={mismatches}")
    print(f"queue_aggregate_vs_sequential={aggregate / rate('endpoint'):.3f}")
    print(f"queue_max_wait_ms={max(wait for _, wait in results):.0f}")
    print(f"ollama_ttft_overhead_ms={ttft_overhead_ms('ollama'):.1f}")
    print(f"embeddings_per_s={median(embed_rates['endpoint']) / median(embed_rates['raw']):.3f}")
    print(f"endpoint_vs_sdk={rate('endpoint') / rate('direct'):.3f}")
    print(f"ollama_vs_sdk={rate('ollama') / rate('direct'):.3f}")
    print(f"messages_vs_sdk={rate('messages') / rate('direct'):.3f}")
    print(f"responses_vs_sdk={rate('responses') / rate('direct'):.3f}")
    print(f"json_schema_step_overhead={median(schema_runs['schema']) / median(schema_runs['free']) - 1:.3f}")
    print(f"tool_call_step_overhead={median(schema_runs['tools']) / median(schema_runs['free']) - 1:.3f}")
    print(f"ttft_overhead_ms={ttft_overhead_ms('endpoint'):.1f}")


if __name__ == "__main__":
    main()
