/**
 * The gRPC carrier for Node and Electron (`@grpc/grpc-js`): one `CollaborativeDecoding.Decode` bidirectional
 * stream per session (Python: `edge_sdk.protocol.channels.GrpcChannel`, the channel options of `EdgeClient`).
 */

import type * as Grpc from "@grpc/grpc-js";
import { CloudError, InvalidArgumentError, RETRYABLE_CODES } from "../core/errors.js";
import { requirePeer } from "../peer.js";
import { Inbox, isLoopback, streamEnded, type MessageChannel } from "./channel.js";

/** `@grpc/grpc-js`, an optional peer dependency (`MissingPeerDependencyError` naming it when not installed). */
function grpcJs(): typeof Grpc {
  return requirePeer<typeof Grpc>("@grpc/grpc-js", "the gRPC carrier (GrpcCarrier)");
}

/** The method every session streams on (`proto/coveil.proto`). */
export const DECODE_METHOD = "/coveil.v1.CollaborativeDecoding/Decode";

/** How to authenticate to a cloud adapter (Python: `edge_sdk.client.Credentials`). TLS unless `plaintext`, which is
 * accepted only for a loopback address. */
export interface Credentials {
  /** sent as `authorization: Bearer <token>` */
  token?: string;
  /** PEM of the CA that signed the server's certificate (default: the system's roots) */
  rootCert?: Uint8Array;
  clientCert?: Uint8Array;
  clientKey?: Uint8Array;
  plaintext?: boolean;
}

/** Checks credentials as Python's `Credentials.__post_init__` does; the channel credentials for `target`. */
export function channelCredentials(target: string, credentials: Credentials): Grpc.ChannelCredentials {
  if (credentials.token !== undefined && !credentials.token.trim()) {
    throw new InvalidArgumentError("an empty bearer token authenticates nobody: pass no token for none");
  }
  if ((credentials.clientCert === undefined) !== (credentials.clientKey === undefined)) {
    throw new InvalidArgumentError("clientCert and clientKey go together (mutual TLS)");
  }
  if (credentials.plaintext) {
    if (credentials.rootCert !== undefined || credentials.clientCert !== undefined) {
      throw new InvalidArgumentError("plaintext cannot use TLS material (rootCert, clientCert)");
    }
    if (!isLoopback(target)) {
      throw new InvalidArgumentError(`refusing plaintext to ${target}: it is not a loopback address; give the adapter's CA ` +
        "(rootCert) or rely on the system's trust roots");
    }
    return grpcJs().credentials.createInsecure();
  }
  const buffer = (pem?: Uint8Array) => (pem === undefined ? null : Buffer.from(pem));
  return grpcJs().credentials.createSsl(buffer(credentials.rootCert), buffer(credentials.clientKey), buffer(credentials.clientCert));
}

/** A status as the edge receives it. */
function statusError(status: Partial<Grpc.StatusObject>): CloudError {
  const { status: codes } = grpcJs();
  const code = codes[status.code ?? codes.UNKNOWN] ?? "UNKNOWN";
  return new CloudError(code, status.details ?? "", { retryable: RETRYABLE_CODES.has(code) });
}

/** One `Decode` stream on a gRPC client, begun by the first {@link send}. */
export class GrpcChannel implements MessageChannel {
  readonly crossesNetwork = true;
  private call: Grpc.ClientDuplexStream<Uint8Array, Uint8Array> | null = null;
  private readonly inbox = new Inbox();

  constructor(
    private readonly client: Grpc.Client,
    private readonly metadata: Grpc.Metadata,
    private readonly timeoutMs: number | null,
  ) {}

  private begun(): Grpc.ClientDuplexStream<Uint8Array, Uint8Array> {
    if (this.call === null) {
      const options: Grpc.CallOptions = this.timeoutMs === null ? {} : { deadline: Date.now() + this.timeoutMs };
      const call = this.client.makeBidiStreamRequest<Uint8Array, Uint8Array>(
        DECODE_METHOD,
        (message) => Buffer.from(message.buffer, message.byteOffset, message.byteLength),
        (data) => new Uint8Array(data.buffer, data.byteOffset, data.byteLength),
        this.metadata,
        options,
      );
      call.on("data", (message: Uint8Array) => this.inbox.push(message));
      call.on("error", (error: Grpc.ServiceError) => this.inbox.end(statusError(error)));
      // every call ends with its status (OK: the cloud ended the stream after its last message)
      call.on("status", (status: Grpc.StatusObject) =>
        this.inbox.end(status.code === grpcJs().status.OK ? streamEnded() : statusError(status)));
      this.call = call;
    }
    return this.call;
  }

  /** Resolves once gRPC has written the message to the transport (its write callback), or the stream has ended
   * (`receive` then reports why). */
  send(message: Uint8Array): Promise<void> {
    const call = this.begun();
    return new Promise((resolve) => {
      if (this.inbox.isEnded) {
        resolve();
        return;
      }
      call.write(message, () => resolve());
    });
  }

  receive(): Promise<Uint8Array> {
    this.begun();
    return this.inbox.next();
  }

  close(): void {
    if (this.call !== null) {
      this.call.end();
      this.call.cancel();
    }
  }
}

/** Reconnect backoff on the adapter's channel, first and longest (ms), as the Python client sets it. */
export const RECONNECT_BACKOFF_MS = [500, 2000] as const;

/** A gRPC client to one cloud adapter; {@link channel} begins a session's stream. */
export class GrpcCarrier {
  private readonly client: Grpc.Client;
  private readonly metadata: Grpc.Metadata;

  constructor(readonly target: string, credentials: Credentials = {}, readonly timeoutMs: number | null = 900_000) {
    const grpc = grpcJs();
    this.metadata = new grpc.Metadata();
    this.client = new grpc.Client(target, channelCredentials(target, credentials), {
      "grpc.max_receive_message_length": 64 << 20,
      "grpc.max_send_message_length": 64 << 20,
      "grpc.keepalive_time_ms": 20_000,
      "grpc.keepalive_timeout_ms": 10_000,
      "grpc.keepalive_permit_without_calls": 1,
      "grpc.initial_reconnect_backoff_ms": RECONNECT_BACKOFF_MS[0],
      "grpc.max_reconnect_backoff_ms": RECONNECT_BACKOFF_MS[1],
    });
    if (credentials.token !== undefined) this.metadata.set("authorization", `Bearer ${credentials.token}`);
  }

  channel(): GrpcChannel {
    return new GrpcChannel(this.client, this.metadata, this.timeoutMs);
  }

  close(): void {
    this.client.close();
  }
}
