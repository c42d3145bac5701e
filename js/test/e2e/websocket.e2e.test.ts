/**
 * End to end in Node over WebSocket (the adapter's `/coveil/v1/decode` route, per the WebSocket carrier contract):
 * the TypeScript SDK sends what the Python SDK sends over gRPC and decodes its tokens, with the token in the
 * `Authorization` header (Node) or as the `coveil.bearer.` subprotocol (browsers); a wrong token is UNAUTHENTICATED.
 */

import { mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { NodeLlamaCppSLM } from "../../src/backends/nodeLlamaCpp.js";
import { WS_PATH, WebSocketChannel, type WebSocketFactory } from "../../src/carriers/websocket.js";
import { nodeWebSocket } from "../../src/carriers/websocketNode.js";
import { CloudError } from "../../src/core/errors.js";
import { CloudConnection } from "../../src/loop/connection.js";
import { CollaborativeDecoder } from "../../src/loop/decoder.js";
import { Undefended } from "../../src/policies/undefended.js";
import { MEDPRIV, RecordingChannel, embeddedGguf, pythonEdge, startAdapter, type Adapter } from "./adapter.js";

const items = readFileSync(MEDPRIV, "utf8").split("\n").filter(Boolean).map((line) => JSON.parse(line));
const TOKEN = process.env.COVEIL_TOKEN_E2E ?? "tok-e2e";

/** The browser's way over the `ws` package: no headers, the token as a subprotocol. */
const browserLike: WebSocketFactory = { ...nodeWebSocket, setsHeaders: false };

let adapter: Adapter;
let slm: NodeLlamaCppSLM;

beforeAll(async () => {
  const dir = mkdtempSync(join(tmpdir(), "coveil-ws-"));
  writeFileSync(join(dir, "tokens.txt"), `${TOKEN}\n`);
  [adapter, slm] = await Promise.all([
    startAdapter(["--token-file", join(dir, "tokens.txt")], true),
    embeddedGguf().then(({ path, name }) => NodeLlamaCppSLM.load(path, { name })),
  ]);
}, 300_000);

afterAll(async () => {
  await slm?.close();
  adapter?.stop();
});

async function tsOverWebSocket(index: number, factory: WebSocketFactory, token: string, maxNewTokens: number) {
  const item = items[index];
  const query = `Question: ${item.public_query}\nAnswer:`;
  const slmPrompt = await slm.tokenize(`${item.private_context}\n\n${query}`, { addBos: true });
  const cloudPrompt = await slm.tokenize(query, { addBos: true });
  const decoder = new CollaborativeDecoder(slm, new Undefended(), { mode: "edge", maxNewTokens, autoPaceMs: null }, { slmPrompt, cloudPrompt });
  const channel = new RecordingChannel(new WebSocketChannel(`${adapter.wsUrl}${WS_PATH}`, factory, token));
  const connection = new CloudConnection(channel);
  try {
    for await (const _event of decoder.steps(connection)) { /* to the end */ }
  } finally {
    await connection.close();
  }
  return { decoder, channel };
}

describe("the TypeScript SDK over the adapter's WebSocket route", () => {
  let python: Awaited<ReturnType<typeof pythonEdge>>;

  it("sends the bytes the Python SDK sends over gRPC and decodes its greedy tokens (token in the header)", async () => {
    python = await pythonEdge(adapter.target, 3, { mode: "edge", maxNewTokens: 10, token: TOKEN });
    const ts = await tsOverWebSocket(3, nodeWebSocket, TOKEN, 10);
    expect(ts.decoder.tokens).toEqual(python.tokens);
    expect(ts.channel.sent).toEqual(python.sent);
    expect(ts.channel.received.map((m) => m.length)).toEqual(python.received.map((m) => m.length));
  }, 300_000);

  it("the browser's bearer subprotocol authenticates the same session", async () => {
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
