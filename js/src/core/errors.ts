/**
 * The error types of a session, at both ends, as in Python's `edge_sdk.protocol.status`: a gRPC status code name and a
 * message that names what is wrong, never private data.
 */

/** gRPC status codes after which reopening the session may succeed (Python: `RETRYABLE_CODES`). */
export const RETRYABLE_CODES: ReadonlySet<string> = new Set([
  "UNAVAILABLE",
  "ABORTED",
  "INTERNAL",
  "UNKNOWN",
  "DEADLINE_EXCEEDED",
  "CANCELLED",
]);

/** A session's error status: `code` names a gRPC status code, `message` says why (Python: `CloudError`). */
export class CloudError extends Error {
  readonly code: string;
  readonly detail: string;
  readonly retryable: boolean;

  constructor(code: string, message: string, options: { retryable?: boolean } = {}) {
    super(`${code}: ${message}`);
    this.name = "CloudError";
    this.code = code;
    this.detail = message;
    this.retryable = options.retryable ?? false;
  }
}

/** The edge's own check of what the cloud sent failed (`DATA_LOSS`): the edge ended the session, not the cloud. */
export class CloudReplyRejected extends CloudError {
  constructor(message: string) {
    super("DATA_LOSS", message);
    this.name = "CloudReplyRejected";
  }
}

/**
 * Bad input to the SDK (Python raises `ValueError`): a parameter out of range, a malformed row, a mode a policy
 * does not define.  `code` is the status a session reports for it, `INVALID_ARGUMENT`; the message names the
 * parameter, never private data.
 */
export class InvalidArgumentError extends Error {
  readonly code: string = "INVALID_ARGUMENT";

  constructor(message: string) {
    super(message);
    this.name = "InvalidArgumentError";
  }
}

/** A distribution or logits row holds NaN or an infinity (Python: `NonFiniteError`). */
export class NonFiniteError extends InvalidArgumentError {
  constructor(message: string) {
    super(message);
    this.name = "NonFiniteError";
  }
}

/** A policy was asked to act in a fusion mode it does not define (Python: `UnsupportedModeError`). */
export class UnsupportedModeError extends InvalidArgumentError {
  constructor(message: string) {
    super(message);
    this.name = "UnsupportedModeError";
  }
}

/** A name that is not registered (Python: `UnknownNameError`), with the nearest registered names. */
export class UnknownNameError extends InvalidArgumentError {
  constructor(message: string) {
    super(message);
    this.name = "UnknownNameError";
  }
}

/** A decode setting that is not one (Python: the `TypeError` of `DecodeSettings.overridden`, a 400 at the
 * endpoint): the message names it and the settings there are. */
export class UnknownSettingError extends InvalidArgumentError {
  constructor(message: string) {
    super(message);
    this.name = "UnknownSettingError";
  }
}

/**
 * A policy or setting the Python SDK defines and this TypeScript SDK does not implement (`UNIMPLEMENTED`): raised
 * when it is constructed, never replaced by something else that would decide or send differently.
 */
export class NotImplementedInTypeScriptError extends Error {
  readonly code: string = "UNIMPLEMENTED";

  constructor(message: string) {
    super(message);
    this.name = "NotImplementedInTypeScriptError";
  }
}

/**
 * An optional peer dependency of `@coveil/edge` is not installed (`FAILED_PRECONDITION`): the gRPC carrier needs
 * `@grpc/grpc-js`, the Node WebSocket factory `ws`, the node-llama-cpp backend `node-llama-cpp`, the browser backend
 * `@wllama/wllama`; the message names the package to install.
 */
export class MissingPeerDependencyError extends Error {
  readonly code: string = "FAILED_PRECONDITION";

  constructor(readonly packageName: string, usedBy: string) {
    super(`${usedBy} needs the package ${packageName}, an optional peer dependency of @coveil/edge that is not ` +
      `installed: npm install ${packageName}`);
    this.name = "MissingPeerDependencyError";
  }
}
