/**
 * The WebSocket carrier for browsers and React Native (the global `WebSocket`), and Node (the `ws` package, through
 * `websocketNode.ts`): the adapter's `CollaborativeDecoding.Decode` stream at `/coveil/v1/decode`, as agreed with
 * the Python adapter (the WebSocket carrier contract):
 *
 * - the client offers the subprotocol `coveil.v1` and needs the server to select it;
 * - the bearer token goes in `Authorization: Bearer <token>` where the client can set headers, else (browsers) as
 *   a second subprotocol `coveil.bearer.<base64url(token), no padding>`; a refused token fails the upgrade (401);
 * - every binary message is one serialised protobuf message (`EdgeMessage` out, `CloudMessage` in), no envelope;
 *   a text frame is a protocol error (closed with 1003);
 * - a normal end is close code 1000 after the cloud's last message; an error is close code `4000 + gRPC status`
 *   with the status message as the reason, read back as the same `CloudError(status, message)` as over gRPC.
 */

import { CloudError, InvalidArgumentError, RETRYABLE_CODES } from "../core/errors.js";
import { Inbox, isLoopback, streamEnded, type MessageChannel } from "./channel.js";

export const WS_PATH = "/coveil/v1/decode";
export const WS_SUBPROTOCOL = "coveil.v1";
/** A text frame (either way) is a protocol error. */
export const CLOSE_UNSUPPORTED_DATA = 1003;

/** gRPC's status codes by number (close code - 4000). */
export const STATUS_NAMES = [
  "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
  "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
  "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
] as const;

/** What the carrier uses of a WebSocket: the browser's API, which `ws` implements too. */
export interface WebSocketLike {
  binaryType: string;
  readonly protocol: string;
  readonly bufferedAmount: number;
  readonly readyState: number;
  send(data: Uint8Array): void;
  close(code?: number, reason?: string): void;
  onopen: ((event: unknown) => void) | null;
  onmessage: ((event: { data: unknown }) => void) | null;
  onclose: ((event: { code: number; reason: string }) => void) | null;
  onerror: ((event: unknown) => void) | null;
}

/** Opens a socket offering `protocols`; `token` is for a client that can set the `Authorization` header (return
 * `false` as `headers` when it cannot: the token then travels as a subprotocol). */
export interface WebSocketFactory {
  readonly setsHeaders: boolean;
  open(url: string, protocols: string[], token: string | undefined): WebSocketLike;
  /** Resolves once `data` is written to the socket. */
  write(socket: WebSocketLike, data: Uint8Array): Promise<void>;
  /** Why the upgrade failed, when the runtime says (`ws`: the HTTP status), else `null`. */
  refusal?(socket: WebSocketLike): CloudError | null;
}

/** `token` as the browser's bearer subprotocol: `coveil.bearer.` + base64url without padding. */
export function bearerSubprotocol(token: string): string {
  const bytes = new TextEncoder().encode(token);
  let binary = "";
  for (const byte of bytes) binary += String.fromCharCode(byte);
  return `coveil.bearer.${btoa(binary).replaceAll("+", "-").replaceAll("/", "_").replace(/=+$/, "")}`;
}

/** The status a close code carries (`4000 + code`), as the edge receives it. */
export function closeError(code: number, reason: string): CloudError {
  if (code === 1000) return streamEnded();
  const name = code >= 4000 && code - 4000 < STATUS_NAMES.length ? STATUS_NAMES[code - 4000] : null;
  if (name !== null && name !== "OK") return new CloudError(name, reason, { retryable: RETRYABLE_CODES.has(name) });
  return new CloudError("UNAVAILABLE", `the connection closed (code ${code}${reason ? `: ${reason}` : ""})`, { retryable: true });
}

const OPEN = 1;
const tick = () => new Promise<void>((resolve) => setTimeout(resolve, 1));

/** The browser's and React Native's `WebSocket`: no headers (the token goes as a subprotocol); a send is written
 * once the socket's buffer has drained. */
export const globalWebSocket: WebSocketFactory = {
  setsHeaders: false,
  open(url, protocols) {
    const WebSocketClass = (globalThis as { WebSocket?: new (url: string, protocols: string[]) => WebSocketLike }).WebSocket;
    if (WebSocketClass === undefined) throw new Error("this runtime has no global WebSocket: use nodeWebSocket (the ws package)");
    return new WebSocketClass(url, protocols);
  },
  async write(socket, data) {
    socket.send(data);
    while (socket.bufferedAmount > 0 && socket.readyState === OPEN) await tick();
  },
};

/**
 * `url` checked as Python's `WebSocketCarrier` checks it: a `ws://` or `wss://` URL with a host; `ws://` (plaintext:
 * the token and every signal in clear) only to a loopback host; no path means the adapter's route, `WS_PATH`.
 */
export function webSocketUrl(url: string): string {
  let parts: URL;
  try {
    parts = new URL(url);
  } catch {
    throw new InvalidArgumentError(`a WebSocket cloud is a ws:// or wss:// URL with a host, got '${url}'`);
  }
  if ((parts.protocol !== "ws:" && parts.protocol !== "wss:") || !parts.hostname) {
    throw new InvalidArgumentError(`a WebSocket cloud is a ws:// or wss:// URL with a host, got '${url}'`);
  }
  const host = parts.hostname.replace(/^\[|\]$/g, ""); // as Python's urlsplit gives it: [::1] is ::1
  if (parts.protocol === "ws:" && !isLoopback(host)) {
    throw new InvalidArgumentError(`refusing plaintext to ${host}: it is not a loopback address; use wss://`);
  }
  return parts.pathname === "/" ? `${url.replace(/\/+$/, "")}${WS_PATH}` : url;
}

/** One session's WebSocket, opened by the first {@link send}. */
export class WebSocketChannel implements MessageChannel {
  readonly crossesNetwork = true;
  readonly url: string;
  private socket: WebSocketLike | null = null;
  private opened: Promise<void> | null = null;
  private readonly inbox = new Inbox();

  /** `url`: the adapter's route (`webSocketUrl`'s checks: `ws://` to loopback only); `token`: the bearer token,
   * never empty (an empty one authenticates nobody). */
  constructor(
    url: string,
    private readonly factory: WebSocketFactory = globalWebSocket,
    private readonly token?: string,
  ) {
    this.url = webSocketUrl(url);
    if (token !== undefined && !token.trim()) {
      throw new InvalidArgumentError("an empty bearer token authenticates nobody: pass no token for none");
    }
  }

  private begun(): Promise<void> {
    if (this.opened === null) {
      const protocols = [WS_SUBPROTOCOL];
      if (this.token !== undefined && !this.factory.setsHeaders) protocols.push(bearerSubprotocol(this.token));
      const socket = this.factory.open(this.url, protocols, this.factory.setsHeaders ? this.token : undefined);
      socket.binaryType = "arraybuffer";
      this.socket = socket;
      this.opened = new Promise((resolve) => {
        socket.onopen = () => {
          if (socket.protocol !== WS_SUBPROTOCOL) {
            this.inbox.end(new CloudError("UNAVAILABLE", `the server selected the subprotocol '${socket.protocol}', not ` +
              `'${WS_SUBPROTOCOL}'`));
            socket.close(1002, "subprotocol");
          }
          resolve();
        };
        socket.onmessage = ({ data }) => {
          if (data instanceof ArrayBuffer) this.inbox.push(new Uint8Array(data));
          else if (ArrayBuffer.isView(data)) this.inbox.push(new Uint8Array(data.buffer, data.byteOffset, data.byteLength));
          else {
            this.inbox.end(new CloudError("INTERNAL", "protocol violation: the cloud sent a text frame"));
            socket.close(CLOSE_UNSUPPORTED_DATA, "text frame");
          }
        };
        socket.onclose = ({ code, reason }) => {
          this.inbox.end(this.factory.refusal?.(socket) ?? closeError(code, reason));
          resolve();
        };
        socket.onerror = () => undefined; // the close event that follows says how it ended
      });
    }
    return this.opened;
  }

  /** Resolves once the message is written to the socket, or the connection has ended (`receive` says why). */
  async send(message: Uint8Array): Promise<void> {
    await this.begun();
    if (this.inbox.isEnded || this.socket === null || this.socket.readyState !== OPEN) return;
    await this.factory.write(this.socket, message);
  }

  async receive(): Promise<Uint8Array> {
    await this.begun();
    return this.inbox.next();
  }

  close(): void {
    if (this.socket !== null && this.socket.readyState <= OPEN) this.socket.close(1000);
  }
}
