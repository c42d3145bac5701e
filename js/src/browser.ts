/** `@coveil/edge/browser`: what a browser or WebView app adds to the root entry: the SLM on `wllama` (llama.cpp in
 * WebAssembly; `@wllama/wllama` is an optional peer dependency the app installs and loads itself).  The WebSocket
 * carrier on the runtime's own `WebSocket` is in the root entry. */
export * from "./backends/wllama.js";
