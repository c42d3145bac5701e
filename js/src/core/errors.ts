/**
 * The error types of a session, at both ends, as in Python's `edge_sdk.status`: a gRPC status code name and a
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
