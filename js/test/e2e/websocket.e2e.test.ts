/**
 * End to end in Node over WebSocket (the adapter's `/coveil/v1/decode` route, per the WebSocket carrier contract):
 * the TypeScript SDK sends what the Python SDK sends over gRPC and decodes its tokens, with the token in the
 * `Authorization` header (Node) or as the `coveil.bearer.` subprotocol (browsers); a wrong token is UNAUTHENTICATED.
 * The edge-side bytes test runs on each SLM backend; cloud-side, the native addon on llama-cpp-python's build sends
 * the Python SDK's messages byte for byte, uploads included (`compareCloudSideSent`), and a canary in the
 * private context appears in none of its messages.
 */

import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { SLMBackend } from "../../src/backends/base.js";
import { LlamaCppNativeSLM } from "../../src/backends/llamaCppNative.js";
import { NodeLlamaCppSLM } from "../../src/backends/nodeLlamaCpp.js";
import { WS_PATH, WebSocketChannel, type WebSocketFactory } from "../../src/carriers/websocket.js";
import { nodeWebSocket } from "../../src/carriers/websocketNode.js";
import { CloudError } from "../../src/core/errors.js";
import type { Policy } from "../../src/policies/base.js";
import { makePolicy } from "../../src/policies/index.js";
import { Undefended } from "../../src/policies/undefended.js";
import { ReplayDraws } from "../vectors.js";
import { MEDPRIV, RecordingChannel, compareCloudSideSent, embeddedGguf, expectNoCanary, expectSameRun, POLICY_RUNS, pythonEdge,
  SEED, startAdapter, tsDecode, type Adapter } from "./adapter.js";

const items = readFileSync(MEDPRIV, "utf8").split("\n").filter(Boolean).map((line) => JSON.parse(line));
const TOKEN = process.env.COVEIL_TOKEN_E2E ?? "tok-e2e";

/** The browser's way over the `ws` package: no headers, the token as a subprotocol. */
const browserLike: WebSocketFactory = { ...nodeWebSocket, setsHeaders: false };

let adapter: Adapter;
/** the adapter's token file's folder, removed after the tests */
let dir: string | undefined;
let slm: NodeLlamaCppSLM;
let native: LlamaCppNativeSLM;
let nativePython: LlamaCppNativeSLM;
const BACKENDS = ["node-llama-cpp", "native", "native-python"] as const;
const backend = (name: (typeof BACKENDS)[number]): SLMBackend =>
  ({ "node-llama-cpp": slm, native, "native-python": nativePython })[name];

beforeAll(async () => {
  dir = mkdtempSync(join(tmpdir(), "coveil-ws-"));
  writeFileSync(join(dir, "tokens.txt"), `${TOKEN}\n`);
  [adapter, slm, native, nativePython] = await Promise.all([
    startAdapter(["--token-file", join(dir, "tokens.txt")], true),
    embeddedGguf().then(({ path, name }) => NodeLlamaCppSLM.load(path, { name })),
    embeddedGguf().then(({ path, name }) => LlamaCppNativeSLM.load(path, { name })),
    embeddedGguf().then(({ path, name }) => LlamaCppNativeSLM.load(path, { name, llamaCpp: "llama-cpp-python" })),
  ]);
}, 300_000);

afterAll(async () => {
  await slm?.close();
  await native?.close();
  await nativePython?.close();
  adapter?.stop();
  if (dir !== undefined) rmSync(dir, { recursive: true, force: true });
});

/** The TypeScript SDK's decode of item `index` over the WebSocket route (undefended unless `policy` is given). */
function tsOverWebSocket(index: number, factory: WebSocketFactory, token: string, maxNewTokens: number,
  options: { slm?: SLMBackend; mode?: "edge" | "cloud"; canary?: string; policy?: Policy; draws?: ReplayDraws } = {}) {
  const channel = new RecordingChannel(new WebSocketChannel(`${adapter.wsUrl}${WS_PATH}`, factory, token));
  return tsDecode(options.slm ?? slm, options.policy ?? new Undefended(), items[index], channel,
    { ...options, mode: options.mode ?? "edge", maxNewTokens });
}

describe("the TypeScript SDK over the adapter's WebSocket route", () => {
  let python: Awaited<ReturnType<typeof pythonEdge>> | undefined;

  for (const name of BACKENDS) it(`edge-side, ${name}: sends the bytes the Python SDK sends over gRPC and decodes its greedy tokens (token in the header)`, async () => {
    python ??= await pythonEdge(adapter.target, 3, { mode: "edge", maxNewTokens: 10, token: TOKEN });
    const ts = await tsOverWebSocket(3, nodeWebSocket, TOKEN, 10, { slm: backend(name) });
    expect(ts.decoder.tokens).toEqual(python.tokens);
    expect(ts.channel.sent).toEqual(python.sent);
    expect(ts.channel.received.map((m) => m.length)).toEqual(python.received.map((m) => m.length));
  }, 300_000);

  it("cloud-side, native-python: the Python SDK's tokens, every message byte for byte, uploads included", async () => {
    const cloudPython = await pythonEdge(adapter.target, 3, { mode: "cloud", maxNewTokens: 6, token: TOKEN });
    const ts = await tsOverWebSocket(3, nodeWebSocket, TOKEN, 6, { slm: backend("native-python"), mode: "cloud" });
    expect(ts.decoder.tokens).toEqual(cloudPython.tokens);
    const { uploads, worst } = compareCloudSideSent(ts.channel.sent, cloudPython.sent);
    process.stderr.write(`WebSocket cloud-side, native-python: ${uploads} uploads, values at most ${worst} ulps apart\n`);
    expect(uploads).toBe(6);
  }, 300_000);

  it("cloud-side, native-python: a canary in the private context appears in no message (text or token ids)", async () => {
    const canary = " Patient code QX7-ZEBRA-4417.";
    const ts = await tsOverWebSocket(3, nodeWebSocket, TOKEN, 6, { slm: backend("native-python"), mode: "cloud", canary });
    await expectNoCanary(canary, nativePython, ts.slmPrompt, [...ts.channel.sent, ...ts.channel.received], 6);
  }, 300_000);

  for (const [policy, mode] of POLICY_RUNS) it(`${policy}, ${mode}-side, MedPriv item 3, native-python: the Python SDK's tokens, every message up byte for byte, the same ledger`, async () => {
    const python = await pythonEdge(adapter.target, 3, { mode, maxNewTokens: 6, policy, seed: SEED, token: TOKEN });
    const draws = new ReplayDraws(python.draws);
    const ts = await tsOverWebSocket(3, nodeWebSocket, TOKEN, 6, { slm: backend("native-python"), mode, policy: makePolicy(policy), draws });
    expectSameRun(ts, python, draws);
  }, 300_000);

  it("the browser's bearer subprotocol authenticates the same session", async () => {
    python ??= await pythonEdge(adapter.target, 3, { mode: "edge", maxNewTokens: 10, token: TOKEN });
    const ts = await tsOverWebSocket(3, browserLike, TOKEN, 10);
    expect(ts.decoder.tokens).toEqual(python.tokens);
  }, 300_000);

  it("a wrong token: the upgrade is refused, UNAUTHENTICATED, not retried", async () => {
    for (const factory of [nodeWebSocket, browserLike]) {
      const error = await tsOverWebSocket(3, factory, "not-the-token", 2).catch((e: unknown) => e);
      expect(error).toBeInstanceOf(CloudError);
      expect(error).toMatchObject({ code: "UNAUTHENTICATED", retryable: false });
    }
  }, 300_000);
});
