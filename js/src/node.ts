/** `@coveil/edge/node`: what runs only in Node and Electron's main process: the gRPC carrier, the `ws` WebSocket
 * factory, the node-llama-cpp backend and the native llama.cpp one.  `@grpc/grpc-js`, `ws` and `node-llama-cpp` are
 * optional peer dependencies, loaded when first used: one that is not installed is `MissingPeerDependencyError`
 * naming it. */
export * from "./carriers/grpc.js";
export * from "./carriers/websocketNode.js";
export * from "./backends/nodeLlamaCpp.js";
export * from "./backends/llamaCppNative.js";
