/**
 * The WebSocket carrier in Node and Electron's main process: the `ws` package, which sets the `Authorization`
 * header and says when a message is written (its send callback) and why an upgrade was refused (the HTTP status).
 */

import type WebSocket from "ws";
import { CloudError, InvalidArgumentError } from "../core/errors.js";
import { requirePeer } from "../peer.js";
import type { WebSocketFactory, WebSocketLike } from "./websocket.js";

const refusals = new WeakMap<object, number>();

/** TLS material for `wss://` (Python: `Credentials`' `root_cert`, `client_cert`, `client_key`; PEM). */
export interface WebSocketTls {
  /** the CA that signed the adapter's certificate (default: the system's roots) */
  rootCert?: Uint8Array;
  clientCert?: Uint8Array;
  clientKey?: Uint8Array;
}

/**
 * The `ws` factory, with `tls` for `wss://`. Compression is never offered (`perMessageDeflate: false`, as Python's
 * client offers none): a compressed message's size depends on its content, which would undo the padding to public
 * sizes.
 */
export function nodeWebSocketWith(tls: WebSocketTls = {}): WebSocketFactory {
  if ((tls.clientCert === undefined) !== (tls.clientKey === undefined)) {
    throw new InvalidArgumentError("clientCert and clientKey go together (mutual TLS)");
  }
  const pem = (bytes?: Uint8Array) => (bytes === undefined ? undefined : Buffer.from(bytes));
  return { ...nodeWebSocketBase, open(url, protocols, token) {
    const WebSocketClass = requirePeer<typeof WebSocket>("ws", "the Node WebSocket carrier (nodeWebSocket)");
    const socket = new WebSocketClass(url, protocols, {
      perMessageDeflate: false,
      ...(token === undefined ? {} : { headers: { Authorization: `Bearer ${token}` } }),
      ...(url.startsWith("wss:") ? { ca: pem(tls.rootCert), cert: pem(tls.clientCert), key: pem(tls.clientKey) } : {}),
    });
    socket.on("unexpected-response", (request, response) => {
      refusals.set(socket, response.statusCode ?? 0);
      request.destroy();
      socket.emit("close", 1006, Buffer.alloc(0));
    });
    return socket as unknown as WebSocketLike;
  } };
}

const nodeWebSocketBase: Omit<WebSocketFactory, "open"> = {
  setsHeaders: true,
  write(socket, data) {
    return new Promise((resolve) => (socket as unknown as WebSocket).send(data, () => resolve()));
  },
  refusal(socket) {
    const status = refusals.get(socket);
    if (status === undefined) return null;
    return status === 401
      ? new CloudError("UNAUTHENTICATED", "the adapter refused the bearer token (HTTP 401)")
      : new CloudError("UNAVAILABLE", `the adapter refused the WebSocket upgrade (HTTP ${status})`, { retryable: true });
  },
};

/** The `ws` factory without TLS material of its own (`wss://` verified against the system's roots). */
export const nodeWebSocket: WebSocketFactory = nodeWebSocketWith();
