/**
 * wllama (llama.cpp in WebAssembly) and the CoVeil SDK in a page: the private context stays in the page, the cloud
 * adapter is reached over its WebSocket route, and the ledger shows what left the device at each step.
 * Parameters in the URL: ws (the adapter's ws://host:port), model (the GGUF's URL), name and fingerprint (hex) of
 * its vocabulary, token (the bearer token, sent as the coveil.bearer subprotocol), item (a MedPriv item as JSON).
 */

import { Wllama } from "@wllama/wllama/esm/index.js";
import wasmUrl from "@wllama/wllama/esm/single-thread/wllama.wasm?url";
import { CloudConnection, CollaborativeDecoder, WS_PATH, WebSocketChannel, makePolicy } from "@coveil/edge";
import { WllamaSLM } from "@coveil/edge/browser";

const params = new URLSearchParams(location.search);
const item = JSON.parse(params.get("item") ?? "{}") as { private_context: string; public_query: string };
const show = (id: string, text: string) => (document.getElementById(id)!.textContent = text);
const hex = (text: string) => Uint8Array.from(text.match(/../g)!.map((byte) => parseInt(byte, 16)));

async function main(): Promise<void> {
  show("private", item.private_context);
  show("question", item.public_query);
  const wllama = new Wllama({ "single-thread/wllama.wasm": wasmUrl }, { suppressNativeLog: true });
  await wllama.loadModelFromUrl(params.get("model")!, { n_ctx: 1024, n_batch: 256, useCache: false });
  const slm = new WllamaSLM(wllama, { name: params.get("name")!, vocabFingerprint: hex(params.get("fingerprint")!) });
  const query = `Question: ${item.public_query}\nAnswer:`;
  const slmPrompt = await slm.tokenize(`${item.private_context}\n\n${query}`, { addBos: true });
  const decoder = new CollaborativeDecoder(slm, makePolicy("coveil"), { mode: "edge", maxNewTokens: Number(params.get("tokens") ?? 6) }, {
    slmPrompt, cloudPrompt: await slm.tokenize(query, { addBos: true }),
  });
  show("status", "decoding…");
  const channel = new WebSocketChannel(`${params.get("ws")}${WS_PATH}`, undefined, params.get("token") ?? undefined);
  const connection = new CloudConnection(channel, 8);
  const ledger = document.getElementById("ledger")!;
  try {
    for await (const step of decoder.steps(connection)) {
      show("answer", await slm.detokenize(decoder.tokens));
      const e = step.entry;
      const row = ledger.appendChild(document.createElement("tr"));
      if (e.steered) row.className = "steered";
      for (const cell of [e.step, JSON.stringify(await slm.detokenize([e.token_id])), e.signal, e.steered ? "yes" : "no", e.bytes_up, e.bytes_down]) {
        row.appendChild(document.createElement("td")).textContent = String(cell);
      }
    }
  } finally {
    await connection.close();
  }
  // the ids, for whoever checks the page against another SDK's run
  Object.assign(document.getElementById("answer")!.dataset, { tokens: JSON.stringify(decoder.tokens), prompt: JSON.stringify(slmPrompt) });
  show("status", `done: ${decoder.tokens.length} tokens, ${decoder.ledger.bytesUp} B up / ${decoder.ledger.bytesDown} B down; ` +
    (decoder.ledger.inWords() ?? ""));
  document.title = "done";
}

main().catch((error: unknown) => {
  show("status", `error: ${String(error)}`);
  document.title = "error";
});
