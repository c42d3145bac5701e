import { describe, expect, it } from "vitest";
import { Inbox, isLoopback } from "../src/carriers/channel.js";
import { WebSocketChannel, bearerSubprotocol, closeError, type WebSocketFactory, type WebSocketLike } from "../src/carriers/websocket.js";
import * as grpc from "@grpc/grpc-js";
import { GrpcChannel, channelCredentials } from "../src/carriers/grpc.js";
import { CloudError, InvalidArgumentError } from "../src/core/errors.js";
import { WebSocketServer } from "ws";
import { nodeWebSocket, nodeWebSocketWith } from "../src/carriers/websocketNode.js";

/** A socket the test drives by hand. */
class FakeSocket implements WebSocketLike {
  binaryType = "blob";
  protocol = "coveil.v1";
  bufferedAmount = 0;
  readyState = 0;
  closed: [number | undefined, string | undefined] | null = null;
  onopen: ((event: unknown) => void) | null = null;
  onmessage: ((event: { data: unknown }) => void) | null = null;
  onclose: ((event: { code: number; reason: string }) => void) | null = null;
  onerror: ((event: unknown) => void) | null = null;
  constructor(readonly url: string, readonly protocols: string[], readonly token: string | undefined) {}
  send(): void {}
  close(code?: number, reason?: string): void {
    this.closed = [code, reason];
  }
  open(): void {
    this.readyState = 1;
    this.onopen?.({});
  }
}

function fakeFactory(setsHeaders: boolean) {
  const sockets: FakeSocket[] = [];
  const writes: Array<() => void> = [];
  const factory: WebSocketFactory = {
    setsHeaders,
    open(url, protocols, token) {
      const socket = new FakeSocket(url, protocols, token);
      sockets.push(socket);
      queueMicrotask(() => socket.open());
      return socket;
    },
    write: () => new Promise<void>((resolve) => writes.push(resolve)),
  };
  return { factory, sockets, writes };
}

describe("the WebSocket carrier keeps the carrier contract", () => {
  it("opens the connection at the first send, not before; send resolves only once written", async () => {
    const { factory, sockets, writes } = fakeFactory(true);
    const channel = new WebSocketChannel("ws://127.0.0.1:1/coveil/v1/decode", factory, "t");
    expect(sockets.length).toBe(0);
    let resolved = false;
    const sending = channel.send(new Uint8Array([1])).then(() => (resolved = true));
    await new Promise((r) => setTimeout(r, 5));
    expect(sockets.length).toBe(1);
    expect(resolved).toBe(false); // handed to the socket, not yet written
    writes[0]();
    await sending;
    expect(resolved).toBe(true);
    expect(sockets[0].protocols).toEqual(["coveil.v1"]);
    expect(sockets[0].token).toBe("t"); // in the header
  });

  it("a client without headers offers the token as coveil.bearer.<base64url, no padding>", async () => {
    const { factory, sockets, writes } = fakeFactory(false);
    const channel = new WebSocketChannel("ws://127.0.0.1:1/coveil/v1/decode", factory, "tok?>");
    const sending = channel.send(new Uint8Array([1]));
    await new Promise((r) => setTimeout(r, 5));
    writes[0]();
    await sending;
    // base64 of "tok?>" is "dG9rPz4=": url-safe, unpadded
    expect(sockets[0].protocols).toEqual(["coveil.v1", "coveil.bearer.dG9rPz4"]);
    expect(bearerSubprotocol("\u00ff\u00fe")).toBe("coveil.bearer.w7_Dvg"); // UTF-8 c3 bf c3 be: base64 w7/Dvg==
  });

  it("binary frames arrive in order; a text frame is a protocol error closed with 1003", async () => {
    const { factory, sockets, writes } = fakeFactory(true);
    const channel = new WebSocketChannel("ws://127.0.0.1:1/coveil/v1/decode", factory);
    const sending = channel.send(new Uint8Array([1]));
    await new Promise((r) => setTimeout(r, 5));
    writes[0]();
    await sending;
    sockets[0].onmessage?.({ data: new Uint8Array([9, 8]).buffer });
    sockets[0].onmessage?.({ data: "hello" });
    expect(Array.from(await channel.receive())).toEqual([9, 8]);
    await expect(channel.receive()).rejects.toMatchObject({ code: "INTERNAL" });
    expect(sockets[0].closed?.[0]).toBe(1003);
  });

  it("close codes map back to the status the stream ended with", () => {
    expect(closeError(4008, "too many")).toMatchObject({ code: "RESOURCE_EXHAUSTED", detail: "too many", retryable: false });
    expect(closeError(4014, "down")).toMatchObject({ code: "UNAVAILABLE", retryable: true });
    expect(closeError(4016, "who")).toMatchObject({ code: "UNAUTHENTICATED" });
    expect(closeError(1000, "")).toMatchObject({ code: "UNAVAILABLE", retryable: true }); // ended after the last message
    expect(closeError(1006, "")).toMatchObject({ code: "UNAVAILABLE", retryable: true });
  });

  it("a server that does not select coveil.v1 is refused", async () => {
    const { factory, sockets } = fakeFactory(true);
    const original = factory.open;
    factory.open = (url, protocols, token) => {
      const socket = original(url, protocols, token) as FakeSocket;
      socket.protocol = "";
      return socket;
    };
    const channel = new WebSocketChannel("ws://127.0.0.1:1/coveil/v1/decode", factory);
    await channel.send(new Uint8Array([1]));
    await expect(channel.receive()).rejects.toBeInstanceOf(CloudError);
    expect(sockets[0].closed).not.toBeNull();
  });
});

describe("the WebSocket carrier's checks, as Python's WebSocketCarrier's", () => {
  it("ws:// (plaintext) only to a loopback host; a URL that is not ws:// or wss:// with a host is refused", () => {
    // the messages Python gives (edge_sdk/protocol/websocket.py, WebSocketCarrier)
    expect(() => new WebSocketChannel("ws://cloud.example:8000/coveil/v1/decode")).toThrow(new InvalidArgumentError(
      "refusing plaintext to cloud.example: it is not a loopback address; use wss://"));
    expect(() => new WebSocketChannel("ws://10.0.0.5/x")).toThrow("refusing plaintext to 10.0.0.5");
    for (const url of ["http://127.0.0.1:8000/coveil/v1/decode", "not a url"]) {
      expect(() => new WebSocketChannel(url)).toThrow(new InvalidArgumentError(
        `a WebSocket cloud is a ws:// or wss:// URL with a host, got '${url}'`));
    }
    for (const url of ["ws://localhost:1/a", "ws://127.0.0.9:1/a", "ws://[::1]:1/a", "wss://cloud.example/a"]) {
      expect(new WebSocketChannel(url).url).toBe(url);
    }
  });

  it("no path means the adapter's route; an empty token is refused", () => {
    expect(new WebSocketChannel("ws://127.0.0.1:8000").url).toBe("ws://127.0.0.1:8000/coveil/v1/decode");
    expect(new WebSocketChannel("wss://cloud.example/").url).toBe("wss://cloud.example/coveil/v1/decode");
    let error: unknown;
    try {
      new WebSocketChannel("ws://127.0.0.1:1/a", undefined, "  ");
    } catch (caught) {
      error = caught;
    }
    expect(error).toBeInstanceOf(InvalidArgumentError);
    expect((error as InvalidArgumentError).code).toBe("INVALID_ARGUMENT");
  });

  it("Node's ws client offers no compression (a compressed size would show the content) and sends the token as a header", async () => {
    const upgrades: Record<string, string | string[] | undefined>[] = [];
    const server = new WebSocketServer({ port: 0, host: "127.0.0.1", handleProtocols: () => "coveil.v1" });
    server.on("headers", (_headers, request) => upgrades.push(request.headers));
    server.on("connection", (socket) => socket.close(1000));
    await new Promise<void>((resolve) => server.once("listening", () => resolve()));
    const { port } = server.address() as { port: number };
    try {
      const channel = new WebSocketChannel(`ws://127.0.0.1:${port}`, nodeWebSocket, "secret");
      await channel.send(new Uint8Array([1]));
      await channel.receive().catch(() => undefined);
      expect(upgrades).toHaveLength(1);
      expect(upgrades[0]!["sec-websocket-extensions"]).toBeUndefined();
      expect(upgrades[0]!.authorization).toBe("Bearer secret");
    } finally {
      await new Promise<void>((resolve) => server.close(() => resolve()));
    }
  });

  it("mutual TLS needs both the client certificate and its key", () => {
    expect(() => nodeWebSocketWith({ clientCert: new Uint8Array([1]) })).toThrow(
      new InvalidArgumentError("clientCert and clientKey go together (mutual TLS)"));
  });
});

describe("the inbox and the gRPC carrier's checks", () => {
  it("messages come before the end, in order", async () => {
    const inbox = new Inbox();
    inbox.push(new Uint8Array([1]));
    inbox.end(new CloudError("ABORTED", "x"));
    inbox.end(new CloudError("INTERNAL", "later ends do not count"));
    expect(Array.from(await inbox.next())).toEqual([1]);
    await expect(inbox.next()).rejects.toMatchObject({ code: "ABORTED" });
  });

  it("plaintext only to loopback; an empty token is refused", () => {
    expect(["localhost:1", "127.0.0.1:50051", "[::1]:5", "unix:/tmp/s", "ipv4:127.0.0.1:1,127.0.0.2:1"].every(isLoopback)).toBe(true);
    expect(["10.0.0.1:1", "cloud.example:443", "ipv4:127.0.0.1:1,10.0.0.2:1"].some(isLoopback)).toBe(false);
    expect(() => channelCredentials("cloud.example:443", { plaintext: true })).toThrow(/not a loopback address/);
    expect(() => channelCredentials("localhost:1", { plaintext: true, token: " " })).toThrow(/empty bearer token/);
  });
});

describe("the gRPC carrier keeps the carrier contract", () => {
  /** A grpc.Client stand-in: counts the streams begun, holds each write's callback until the test releases it. */
  function fakeClient() {
    const begun: string[] = [];
    const callbacks: Array<() => void> = [];
    const listeners = new Map<string, (value: unknown) => void>();
    const call = {
      on(event: string, listener: (value: unknown) => void) {
        listeners.set(event, listener);
        return call;
      },
      write(_message: Uint8Array, callback: () => void) {
        callbacks.push(callback);
        return true;
      },
      end() {},
      cancel() {},
    };
    const client = {
      makeBidiStreamRequest(method: string) {
        begun.push(method);
        return call;
      },
    };
    return { client: client as unknown as grpc.Client, begun, callbacks, listeners };
  }

  it("begins the Decode stream at the first send, and send resolves only once gRPC has written the message", async () => {
    const { client, begun, callbacks } = fakeClient();
    const channel = new GrpcChannel(client, new grpc.Metadata(), null);
    expect(begun).toEqual([]);
    let resolved = false;
    const sending = channel.send(new Uint8Array([1])).then(() => (resolved = true));
    expect(begun).toEqual(["/coveil.v1.CollaborativeDecoding/Decode"]);
    await new Promise((r) => setTimeout(r, 5));
    expect(resolved).toBe(false);
    callbacks[0]();
    await sending;
    expect(resolved).toBe(true);
  });

  it("the status a stream ends with is the CloudError the edge receives, after the messages before it", async () => {
    const { client, listeners } = fakeClient();
    const channel = new GrpcChannel(client, new grpc.Metadata(), null);
    void channel.send(new Uint8Array([1]));
    listeners.get("data")!(new Uint8Array([5]));
    listeners.get("status")!({ code: grpc.status.RESOURCE_EXHAUSTED, details: "too many sessions", metadata: new grpc.Metadata() });
    expect(Array.from(await channel.receive())).toEqual([5]);
    await expect(channel.receive()).rejects.toMatchObject({ code: "RESOURCE_EXHAUSTED", detail: "too many sessions", retryable: false });
  });
});
