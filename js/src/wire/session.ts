/**
 * What the two ends say when a session opens (Python: `edge_sdk.protocol.wire.SessionRequest`, `SessionInfo`).
 */

import type { FusionSpace } from "../core/fusion.js";
import type { FusionMode } from "../policies/base.js";

export const PROTOCOL_VERSION = 1;
/** The deepest run-ahead an edge accepts unless told otherwise; the cloud's own cap too. */
export const MAX_LOOKAHEAD = 8;

/** Everything the edge tells the cloud when it opens a session (all of it public). */
export interface SessionRequest {
  promptIds: readonly number[];
  mode: FusionMode;
  alpha: number;
  space: FusionSpace;
  temperature: number;
  seed: bigint;
  maxNewTokens: number;
  vocabFingerprint: Uint8Array;
  edgeModel: string;
  vocabSize: number;
  topM: number;
  resumePrefix: readonly number[];
  stopTokenIds: readonly number[];
  logprobs: boolean;
  topLogprobs: number;
  jsonSchema: string;
  /** the deepest run-ahead the edge accepts; 0 = lockstep */
  lookahead: number;
  /** the edge pads its signals to public sizes and asks the cloud to pad its own */
  padded: boolean;
}

/** The cloud's answer to the open. */
export interface SessionInfo {
  sessionId: string;
  cloudModel: string;
  vocabSize: number;
  promptTokens: number;
  eosTokenIds: ReadonlySet<number>;
  maxNewTokens: number;
  protocolVersion: number;
  /** the run-ahead depth the cloud chose (at most the edge's); 0 = lockstep */
  lookahead: number;
  padded: boolean;
}
