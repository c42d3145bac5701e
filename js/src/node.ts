/** `@coveil/edge/node`: what runs only in Node and Electron's main process: the gRPC carrier, the `ws` WebSocket
 * factory and the node-llama-cpp backend. */
export * from "./carriers/grpc.js";
export * from "./carriers/websocketNode.js";
export * from "./backends/nodeLlamaCpp.js";
