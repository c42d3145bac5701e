/**
 * The Python side of the end-to-end tests: a cloud adapter (`coveil-cloud serve`, the embedded model) started for
 * the tests, the Python SDK's run of the same item (`python_edge.py`), the embedded GGUF's path.
 *
 * `COVEIL_PYTHON` names the Python with the CoVeil packages installed (default: the repository's `.venv`, else
 * `python`); `COVEIL_CLOUD` an adapter
 * already serving on loopback (then none is started).
 */

import { execFile, spawn, type ChildProcess } from "node:child_process";
import { existsSync } from "node:fs";
import { createServer, type AddressInfo } from "node:net";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { fromBinary } from "@bufbuild/protobuf";
import { expect } from "vitest";
import type { SLMBackend } from "../../src/backends/base.js";
import type { MessageChannel } from "../../src/carriers/channel.js";
import { CloudConnection } from "../../src/loop/connection.js";
import { CollaborativeDecoder } from "../../src/loop/decoder.js";
import type { Policy } from "../../src/policies/base.js";
import { EdgeMessageSchema, valuesFromBytes } from "../../src/wire/index.js";
import { ReplayDraws } from "../vectors.js";

const run = promisify(execFile);
const here = dirname(fileURLToPath(import.meta.url));
/** the repository's root: the Python packages import from there */
export const REPO = join(here, "..", "..", "..");
/** the Python with the CoVeil packages: `COVEIL_PYTHON`, else the repository's `.venv` (README's install), else `python` */
export const PYTHON = process.env.COVEIL_PYTHON
  ?? (existsSync(join(REPO, ".venv", "bin", "python")) ? join(REPO, ".venv", "bin", "python") : "python");
/** MedPriv as the repository ships it (`COVEIL_MEDPRIV` names another copy) */
export const MEDPRIV = process.env.COVEIL_MEDPRIV ?? join(REPO, "eval_harness", "data", "MEDPRIV.jsonl");
/** the checkout the adapter runs from (`COVEIL_ADAPTER_REPO`; default this one) */
const ADAPTER_REPO = process.env.COVEIL_ADAPTER_REPO ?? REPO;

/** The embedded GGUF's path and the name the Python SDK gives it (what its open says). */
export async function embeddedGguf(): Promise<{ path: string; name: string }> {
  const { stdout } = await run(PYTHON, ["-c", "from edge_sdk.models import embedded_model; m = embedded_model(); " +
    "print(m.gguf_path); print(m.name)"], { cwd: REPO });
  const [path, name] = stdout.trim().split("\n");
  return { path, name };
}

export interface Adapter {
  /** host:port (gRPC) */
  target: string;
  /** ws://host:port of the WebSocket route, when started with one */
  wsUrl: string | null;
  stop(): void;
}

/** A TCP port free on loopback now. */
function freePort(): Promise<number> {
  return new Promise((resolve) => {
    const server = createServer().listen(0, "127.0.0.1", () => {
      const { port } = server.address() as AddressInfo;
      server.close(() => resolve(port));
    });
  });
}

/** Start `coveil-cloud serve` on free ports and wait until it serves (its log line names the port). */
export async function startAdapter(extra: string[] = [], ws = false): Promise<Adapter> {
  if (process.env.COVEIL_CLOUD) return { target: process.env.COVEIL_CLOUD, wsUrl: process.env.COVEIL_CLOUD_WS ?? null, stop() {} };
  const args = ["-m", "cloud_adapter.cli", "serve", "--model", "embedded", "--port", "0", "--threads", "1", ...extra];
  if (ws) args.push("--ws-port", String(await freePort())); // 0 turns the route off
  const child: ChildProcess = spawn(PYTHON, args, { cwd: ADAPTER_REPO, stdio: ["ignore", "ignore", "pipe"] });
  let log = "";
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`the adapter did not start within 240 s:\n${log}`)), 240_000);
    child.on("exit", (code) => reject(new Error(`the adapter exited (${code}):\n${log}`)));
    child.stderr!.on("data", (chunk: Buffer) => {
      log += chunk.toString();
      const port = /serving address=\S+ port=(\d+)/.exec(log);
      const wsPort = /serving_websocket port=(\d+)/.exec(log);
      if (port && (!ws || wsPort)) {
        clearTimeout(timer);
        resolve({
          target: `127.0.0.1:${port[1]}`,
          wsUrl: wsPort ? `ws://127.0.0.1:${wsPort[1]}` : null,
          stop: () => child.kill("SIGTERM"),
        });
      }
    });
  });
}

export interface PythonRun {
  slm_prompt: number[];
  cloud_prompt: number[];
  tokens: number[];
  finish_reason: string;
  sent: string[];
  received: string[];
  /** the ledger's entries without their timings (python_edge.py's TIMINGS) */
  entries: Record<string, unknown>[];
  /** the epsilon ledger (`PrivacyLedger.privacy()`) */
  privacy: Record<string, unknown> | null;
  /** the draws a randomised policy took, in order (conformance vectors' encoding; none without `seed`) */
  draws: [string, string | string[]][];
}

/** The Python SDK's decode of MedPriv item `item` against `target` (see python_edge.py): undefended unless
 * `policy` names another (its default parameters); a randomised one draws from a generator seeded with `seed`. */
export async function pythonEdge(target: string, item: number, options: { mode: string; maxNewTokens: number;
  canary?: string; lookahead?: number; token?: string; policy?: string; seed?: number }): Promise<PythonRun> {
  const seed = options.seed === undefined ? [] : ["--seed", String(options.seed)];
  const { stdout } = await run(PYTHON, [join(here, "python_edge.py"), "--cloud", target, "--item", String(item),
    "--mode", options.mode, "--max-new-tokens", String(options.maxNewTokens), "--canary", options.canary ?? "",
    "--lookahead", String(options.lookahead ?? 0), "--token", options.token ?? "", "--policy", options.policy ?? "undefended",
    ...seed], { cwd: REPO, maxBuffer: 1 << 28, env: { ...process.env, PYTHONPATH: REPO } });
  return JSON.parse(stdout) as PythonRun;
}

/**
 * The policies the byte-for-byte runs cover beyond the undefended one, each in both fusion modes, at their default
 * parameters: CoVeil (lambda 1) and DP-Fusion (epsilon 2 per token; edge-side each token is drawn, from the
 * draws of a numpy generator seeded with {@link SEED} that python_edge.py records and the TypeScript run replays).
 */
export const POLICY_RUNS = (["coveil", "dp_fusion"] as const).flatMap((policy) =>
  (["edge", "cloud"] as const).map((mode) => [policy, mode] as const));
export const SEED = 34;

/** A MedPriv item's two fields the prompts are made of. */
export interface Item { private_context: string; public_query: string }

/**
 * The TypeScript SDK's decode of `item` on `slm` under `policy` over `channel` (recording what crossed it), with
 * python_edge.py's prompts: the private context (and `canary`) then the question for the SLM, the question alone
 * for the cloud.  `draws`: what a randomised policy takes (default: none, so one that draws fails).
 */
export async function tsDecode(slm: SLMBackend, policy: Policy, item: Item, channel: RecordingChannel,
  options: { mode: "cloud" | "edge"; maxNewTokens: number; canary?: string; lookahead?: number; draws?: ReplayDraws }) {
  const query = `Question: ${item.public_query}\nAnswer:`;
  const slmPrompt = await slm.tokenize(`${item.private_context}${options.canary ?? ""}\n\n${query}`, { addBos: true });
  const cloudPrompt = await slm.tokenize(query, { addBos: true });
  const decoder = new CollaborativeDecoder(slm, policy, { mode: options.mode, maxNewTokens: options.maxNewTokens, autoPaceMs: null },
    { slmPrompt, cloudPrompt, draws: options.draws ?? new ReplayDraws([]) });
  const connection = new CloudConnection(channel, options.lookahead ?? 0);
  try {
    for await (const _event of decoder.steps(connection)) { /* decode to the end */ }
  } finally {
    await connection.close();
  }
  return { slmPrompt, cloudPrompt, decoder, channel, connection };
}

/** A ledger entry as python_edge.py prints it: every decided field, no timings. */
function decided(entry: object): Record<string, unknown> {
  const { edge_ms: _e, wait_ms: _w, cloud_forward_ms: _c, pace_overrun: _p, ...rest } = entry as Record<string, unknown>;
  return rest;
}

/**
 * Check a run of the TypeScript SDK (on an SLM whose logits are the Python SDK's bit for bit, fed the draws the
 * Python run took) against the Python SDK's run of the same item and policy: the same prompts, tokens and end,
 * every message up byte for byte (cloud-side through {@link compareCloudSideSent}), messages down of the same
 * sizes, every draw taken, and the same ledger: each step's decided fields and the epsilon ledger.
 */
export function expectSameRun(ts: Awaited<ReturnType<typeof tsDecode>>, python: PythonRun, draws?: ReplayDraws): void {
  expect(ts.slmPrompt).toEqual(python.slm_prompt);
  expect(ts.cloudPrompt).toEqual(python.cloud_prompt);
  expect(ts.decoder.tokens).toEqual(python.tokens);
  expect(ts.decoder.finishReason).toBe(python.finish_reason);
  if (ts.decoder.settings.mode === "cloud") compareCloudSideSent(ts.channel.sent, python.sent);
  else expect(ts.channel.sent).toEqual(python.sent);
  // what came back: the same messages but the session id and the cloud's forward times, in padded sizes
  expect(ts.channel.received.map((m) => m.length)).toEqual(python.received.map((m) => m.length));
  expect(draws?.finished ?? true, "the TypeScript run took every draw the Python run took").toBe(true);
  expect(ts.decoder.ledger.entries.map(decided)).toEqual(python.entries);
  expect(JSON.parse(JSON.stringify(ts.decoder.ledger.privacy()))).toEqual(python.privacy);
}

/** A channel that keeps every message's bytes as hex, each direction. */
export class RecordingChannel implements MessageChannel {
  readonly sent: string[] = [];
  readonly received: string[] = [];

  constructor(private readonly inner: MessageChannel) {}

  get crossesNetwork(): boolean {
    return this.inner.crossesNetwork;
  }

  send(message: Uint8Array): Promise<void> {
    this.sent.push(Buffer.from(message).toString("hex"));
    return this.inner.send(message);
  }

  async receive(): Promise<Uint8Array> {
    const message = await this.inner.receive();
    this.received.push(Buffer.from(message).toString("hex"));
    return message;
  }

  close(): void {
    this.inner.close();
  }
}

/** How many float32 values apart `a` and `b` are (both positive). */
export function ulps(a: number, b: number): number {
  const bits = new Uint32Array(Float32Array.of(a, b).buffer);
  return Math.abs(bits[0] - bits[1]);
}

/**
 * Check a cloud-side run's messages up (hex) against the Python SDK's, from an SLM whose logits are the Python SDK's
 * bit for bit: every message byte for byte, the uploaded values included.  Both SDKs round exp once from float64
 * (the Python softmax's float64 exp, the addon's C exp), so their probabilities agree bit for bit; before, numpy's
 * float32 exp (a SIMD approximation within 2.52 ulps) left the values up to 4 ulps apart.  Returns the count of
 * uploads, of messages byte for byte, and the most ulps two values were apart (0), for the log.
 */
export function compareCloudSideSent(ts: readonly string[], python: readonly string[]): { uploads: number; identical: number; worst: number } {
  expect(ts.length).toBe(python.length);
  let uploads = 0;
  let identical = 0;
  let worst = 0;
  for (let i = 0; i < ts.length; i++) {
    expect(ts[i].length, `message ${i}: padded to the same size`).toBe(python[i].length);
    if (ts[i] === python[i]) identical++;
    const [mine, theirs] = [ts[i], python[i]].map((hex) => fromBinary(EdgeMessageSchema, Buffer.from(hex, "hex")));
    expect(mine.kind.case).toBe(theirs.kind.case);
    if (mine.kind.case !== "signal" || theirs.kind.case !== "signal") continue;
    const [a, b] = [mine.kind.value, theirs.kind.value];
    if (a.signal.case !== "upload" || b.signal.case !== "upload") throw new Error("cloud-side signals are uploads");
    uploads++;
    const [aValues, bValues] = [valuesFromBytes(a.signal.value.values), valuesFromBytes(b.signal.value.values)];
    aValues.forEach((v, j) => { worst = Math.max(worst, ulps(v, bValues[j])); });
  }
  expect(ts).toEqual(python); // every message, byte for byte
  return { uploads, identical, worst };
}

/**
 * Check that `canary`, appended to the private context of a run whose SLM prompt was `slmPrompt`, appears in none of
 * its `messages` (hex; more than `atLeast` of them), neither as text nor as a run of its token ids; and that the
 * check finds it where it is, in the SLM's prompt.
 */
export async function expectNoCanary(canary: string, slm: SLMBackend, slmPrompt: readonly number[], messages: readonly string[],
  atLeast: number): Promise<void> {
  const canaryIds = await slm.tokenize(canary, { addBos: false });
  const asText = Buffer.from(canary.trim(), "utf8").toString("hex");
  const asIds = Buffer.from(new Uint32Array(canaryIds.slice(1, 4)).buffer).toString("hex"); // a run of its ids
  expect(messages.length).toBeGreaterThan(atLeast);
  for (const message of messages) {
    expect(message.includes(asText)).toBe(false);
    expect(message.includes(asIds)).toBe(false);
  }
  expect(Buffer.from(new Uint32Array(slmPrompt).buffer).toString("hex").includes(asIds)).toBe(true);
}
