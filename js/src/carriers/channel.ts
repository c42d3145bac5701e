import { CloudError } from "../core/errors.js";

/**
 * The carrier contract (Python: `edge_sdk.protocol.channels.MessageChannel`): moves the serialised protobuf messages of one
 * session, `EdgeMessage` out and `CloudMessage` in.
 *
 * - the connection (the stream) is opened at the first `send`, never before: the cloud sees when a stream begins,
 *   and the edge connects before its SLM prefills the private prompt, so an early stream would time that prefill;
 * - `send` resolves only once the message is written to the transport (not merely queued), so the SLM's next
 *   forward never runs ahead of the signal it follows;
 * - `receive` resolves with the next message, or rejects with the `CloudError` the stream ended with.
 */

export interface MessageChannel {
  /** whether anyone but this process can time the messages (only such sessions are paced by default) */
  readonly crossesNetwork: boolean;
  send(message: Uint8Array): Promise<void>;
  receive(): Promise<Uint8Array>;
  close(): void;
}

/** A queue of what the cloud sent, read in order: messages, then how the stream ended. */
export class Inbox {
  private readonly messages: Uint8Array[] = [];
  private ended: CloudError | null = null;
  private waiting: { resolve: (m: Uint8Array) => void; reject: (e: CloudError) => void } | null = null;

  push(message: Uint8Array): void {
    if (this.waiting !== null) {
      const { resolve } = this.waiting;
      this.waiting = null;
      resolve(message);
    } else {
      this.messages.push(message);
    }
  }

  /** The stream ended (the first end counts); a reader past the last message gets `error`. */
  end(error: CloudError): void {
    if (this.ended !== null) return;
    this.ended = error;
    if (this.waiting !== null) {
      const { reject } = this.waiting;
      this.waiting = null;
      reject(error);
    }
  }

  get isEnded(): boolean {
    return this.ended !== null;
  }

  next(): Promise<Uint8Array> {
    const message = this.messages.shift();
    if (message !== undefined) return Promise.resolve(message);
    if (this.ended !== null) return Promise.reject(this.ended);
    return new Promise((resolve, reject) => {
      this.waiting = { resolve, reject };
    });
  }
}

/** The cloud ended the stream without a status after its last message. */
export const streamEnded = () => new CloudError("UNAVAILABLE", "the cloud ended the stream", { retryable: true });

/** Whether an address names this machine: `localhost`, `127.0.0.0/8` or `::1`, with or without a port (`host:port`,
 * `[::1]:port`), a gRPC target's list (`ipv4:a,b`) or a Unix socket. */
export function isLoopback(address: string): boolean {
  if (address.startsWith("unix:")) return true;
  if (address.startsWith("ipv4:") || address.startsWith("ipv6:")) return address.slice(5).split(",").every(isLoopback);
  const colons = address.split(":").length - 1;
  let host = colons === 1 || address.startsWith("[") ? address.slice(0, address.lastIndexOf(":")) : address;
  host = host.replace(/^\[|\]$/g, "").toLowerCase();
  return host === "localhost" || /^127\.\d+\.\d+\.\d+$/.test(host) || host === "::1";
}
