/**
 * The WebSocket carrier in Node and Electron's main process: the `ws` package, which sets the `Authorization`
 * header and says when a message is written (its send callback) and why an upgrade was refused (the HTTP status).
 */

import type WebSocket from "ws";
import { CloudError } from "../core/errors.js";
import { requirePeer } from "../peer.js";
import type { WebSocketFactory, WebSocketLike } from "./websocket.js";

const refusals = new WeakMap<object, number>();

export const nodeWebSocket: WebSocketFactory = {
  setsHeaders: true,
  open(url, protocols, token) {
    const WebSocketClass = requirePeer<typeof WebSocket>("ws", "the Node WebSocket carrier (nodeWebSocket)");
    const socket = new WebSocketClass(url, protocols, token === undefined ? {} : { headers: { Authorization: `Bearer ${token}` } });
    socket.on("unexpected-response", (request, response) => {
      refusals.set(socket, response.statusCode ?? 0);
      request.destroy();
      socket.emit("close", 1006, Buffer.alloc(0));
    });
    return socket as unknown as WebSocketLike;
  },
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
