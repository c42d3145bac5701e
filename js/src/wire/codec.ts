/**
 * The edge's side of the codec of `proto/coveil.proto` (Python: `edge_sdk.protocol.wire`): typed values to the generated
 * protobuf-es messages and back, and the public sizes every step signal is padded to.
 */

import { create, toBinary } from "@bufbuild/protobuf";
import { idsFromBytes, idsToBytes, valuesFromBytes, valuesToBytes } from "./bytes.js";
import { InvalidArgumentError } from "../core/errors.js";
import { checkFinite } from "../core/fusion.js";
import { MAX_TOP_LOGPROBS, type TokenLogprobs } from "../core/logprobs.js";
import type { CloudUpload } from "../policies/base.js";
import { FULL_UPLOAD_LIMIT } from "../privacy/masking.js";
import { ReceivedDistribution } from "./distribution.js";
import {
  EdgeMessageSchema,
  FusionMode as PbFusionMode,
  FusionSpace as PbFusionSpace,
  type Distribution,
  type EdgeMessage,
  type SessionOpened,
  type TokenChosen,
} from "./gen/coveil_pb.js";
import { PROTOCOL_VERSION, type SessionInfo, type SessionRequest } from "./session.js";

export { MAX_TOP_LOGPROBS, type TokenLogprobs };

/** An `OpenSession` edge message. */
export function encodeOpen(req: SessionRequest): EdgeMessage {
  return create(EdgeMessageSchema, {
    kind: {
      case: "open",
      value: {
        protocolVersion: PROTOCOL_VERSION,
        publicQuery: { case: "tokenIds", value: { ids: idsToBytes(req.promptIds) } },
        mode: req.mode === "cloud" ? PbFusionMode.CLOUD : PbFusionMode.EDGE,
        space: req.space === "logit" ? PbFusionSpace.LOGIT : PbFusionSpace.PROB,
        alpha: req.alpha,
        temperature: req.temperature,
        seed: req.seed,
        maxNewTokens: req.maxNewTokens,
        vocabFingerprint: req.vocabFingerprint,
        edgeModel: req.edgeModel,
        vocabSize: req.vocabSize,
        topM: req.topM,
        resumePrefix: { ids: idsToBytes(req.resumePrefix) },
        stopTokenIds: { ids: idsToBytes(req.stopTokenIds) },
        logprobs: req.logprobs,
        topLogprobs: req.topLogprobs,
        jsonSchema: req.jsonSchema,
        lookahead: req.lookahead,
        padded: req.padded,
      },
    },
  });
}

export function decodeOpened(msg: SessionOpened): SessionInfo {
  return {
    sessionId: msg.sessionId,
    cloudModel: msg.cloudModel,
    vocabSize: msg.vocabSize,
    promptTokens: msg.promptTokens,
    eosTokenIds: new Set(idsFromBytes(msg.eosTokenIds?.ids ?? new Uint8Array(0))),
    maxNewTokens: msg.maxNewTokens,
    protocolVersion: msg.protocolVersion,
    lookahead: msg.lookahead,
    padded: msg.padded,
  };
}

/** A `Distribution` checked and parsed; `InvalidArgumentError` naming what is malformed. */
export function decodeDistribution(msg: Distribution, vocabSize: number): ReceivedDistribution {
  const assumes = msg.assumesToken ?? null;
  const step = Number(msg.step);
  const forwardNs = Number(msg.forwardNs);
  if (msg.dense.length) {
    const dense = valuesFromBytes(msg.dense);
    if (dense.length !== vocabSize) {
      throw new InvalidArgumentError(`full distribution has ${dense.length} entries, vocabulary has ${vocabSize}`);
    }
    checkFinite(dense, "the cloud's full distribution");
    return new ReceivedDistribution(step, new Int32Array(0), new Float32Array(0), 0, 0, dense, forwardNs, assumes);
  }
  const ids = idsFromBytes(msg.ids);
  const values = valuesFromBytes(msg.values);
  if (ids.length !== values.length) {
    throw new InvalidArgumentError(`sparse distribution has ${ids.length} ids but ${values.length} values`);
  }
  if (ids.some((id) => id >= vocabSize)) throw new InvalidArgumentError("sparse distribution names an id outside the vocabulary");
  checkFinite(values, "the cloud's sparse distribution");
  if (!(Number.isFinite(msg.tailBound) && Number.isFinite(msg.tailMass))) {
    throw new InvalidArgumentError("the cloud's sparse distribution has a non-finite tail bound or tail mass");
  }
  for (let j = 1; j < values.length; j++) {
    if (!(values[j] <= values[j - 1])) {
      throw new InvalidArgumentError("the cloud's sparse distribution does not list its ids by decreasing value");
    }
  }
  if (values.length && msg.tailBound > values[values.length - 1]) {
    throw new InvalidArgumentError("the cloud's tail bound exceeds a value it sent");
  }
  if (new Set(ids).size !== ids.length) throw new InvalidArgumentError("the cloud's sparse distribution lists an id twice");
  return new ReceivedDistribution(step, Int32Array.from(ids), values, msg.tailBound, msg.tailMass, null, forwardNs, assumes);
}

/**
 * A step's upload: an upload of every id of the vocabulary (`0..vocabSize-1`) travels dense (values only), any
 * other sparse.  `noStop`: the cloud must not pick an end-of-generation id at this step.
 */
export function encodeUpload(step: number, upload: CloudUpload, vocabSize: number, noStop = false): EdgeMessage {
  const n = upload.ids.length;
  const dense = n > 1 && n === vocabSize && upload.ids[0] === 0 && upload.ids[n - 1] === n - 1;
  const body = dense
    ? { values: valuesToBytes(upload.values), dense: true }
    : { ids: idsToBytes(upload.ids), values: valuesToBytes(upload.values) };
  return create(EdgeMessageSchema, {
    kind: { case: "signal", value: { step: BigInt(step), signal: { case: "upload", value: body }, noStop } },
  });
}

export function encodeToken(step: number, tokenId: number): EdgeMessage {
  return create(EdgeMessageSchema, {
    kind: { case: "signal", value: { step: BigInt(step), signal: { case: "tokenId", value: tokenId } } },
  });
}

export function encodeRequestFull(step: number): EdgeMessage {
  return create(EdgeMessageSchema, { kind: { case: "requestFull", value: { step: BigInt(step) } } });
}

export function encodeClose(): EdgeMessage {
  return create(EdgeMessageSchema, { kind: { case: "close", value: {} } });
}

/**
 * A `TokenChosen`'s log-probabilities (`null` when it carries none); `InvalidArgumentError` when they are not
 * log-probabilities, name an id outside the vocabulary, are out of order or more than `topN` (<= 20).
 */
export function decodeTokenLogprobs(msg: TokenChosen, vocabSize: number, topN: number): TokenLogprobs | null {
  const body = msg.logprobs;
  if (body === undefined) return null;
  const ids = idsFromBytes(body.topIds);
  const values = valuesFromBytes(body.topLogprobs);
  if (ids.length !== values.length || ids.length > Math.min(topN, MAX_TOP_LOGPROBS)) {
    throw new InvalidArgumentError(`${ids.length} top ids with ${values.length} log-probabilities, at most ${topN} asked for`);
  }
  if (ids.some((id) => id >= vocabSize)) throw new InvalidArgumentError("a top log-probability names an id outside the vocabulary");
  let ordered = body.logprob <= 0;
  for (let j = 0; j < values.length; j++) {
    ordered &&= values[j] <= 0 && (j === 0 || values[j] <= values[j - 1]);
  }
  if (!ordered) throw new InvalidArgumentError("the log-probabilities are not ordered values <= 0");
  return { tokenId: msg.tokenId, logprob: body.logprob, top: Array.from(ids, (id, j) => [id, values[j]] as const) };
}

// -- public sizes ---------------------------------------------------------------------------------------------
//
// A padded step signal is brought to the size of its template: the same message with every field whose length
// could vary at its longest, built from public settings only (Python: `edge_sdk.protocol.wire.pad_edge_message`).

const U32_MAX = 2 ** 32 - 1;
/** What padding adds beyond the template (one empty entry costs 2 bytes; 1 byte cannot be added). */
const PAD_SLACK = 2;
/** `EdgeMessage.padding`'s tag: field 15, length-delimited. */
const PADDING_TAG = (15 << 3) | 2;

function varintSize(value: number): number {
  let size = 1;
  while (value >= 128) {
    value = Math.floor(value / 128);
    size++;
  }
  return size;
}

/** Lengths of padding entries that add exactly `extra` bytes (an entry of n bytes costs 1 + varint(n) + n). */
export function paddingEntries(extra: number): number[] {
  if (extra === 0) return [];
  if (extra < 2) throw new InvalidArgumentError(`padding cannot add ${extra} byte`);
  for (const wanted of [extra, extra - 2]) {
    for (let prefix = 1; prefix < 6; prefix++) {
      const n = wanted - 1 - prefix;
      if (n >= 0 && varintSize(n) === prefix) return wanted === extra ? [n] : [n, 0];
    }
  }
  throw new Error(`no padding of ${extra} bytes`);
}

/** `message` (serialised, holding no padding) with padding entries appended so that it is `size` bytes long:
 * the bytes protobuf writes for the message with those entries (field 15 is written last). */
export function padBytes(message: Uint8Array, size: number): Uint8Array {
  const entries = paddingEntries(size - message.length);
  const out = new Uint8Array(size);
  out.set(message);
  let at = message.length;
  for (const n of entries) {
    out[at++] = PADDING_TAG;
    for (let v = n; ; v = Math.floor(v / 128)) {
      out[at++] = v >= 128 ? (v % 128) | 128 : v;
      if (v < 128) break;
    }
    at += n; // zeros
  }
  return out;
}

/**
 * The largest upload a step may send when the policy uploads at most `maxValues` values: how many ids it lists
 * sparse, and whether it may be dense.
 */
export function uploadTemplateValues(maxValues: number, vocabSize: number): [number, boolean] {
  if (maxValues >= vocabSize) return [Math.min(vocabSize - 1, FULL_UPLOAD_LIMIT), true];
  return [maxValues, false];
}

/** The public sizes of one session's step signals (cached by the length of the step's varint, 0 for step 0,
 * which proto3 leaves out). */
export class SignalSizes {
  private readonly cache = new Map<string, number>();

  constructor(readonly vocabSize: number, readonly maxUpload: number) {}

  /** The padded size of step `step`'s signal: that of the largest the step may send, and the slack. */
  size(kind: "upload" | "token", step: number): number {
    const key = `${kind}:${step === 0 ? 0 : varintSize(step)}`;
    let size = this.cache.get(key);
    if (size === undefined) {
      size = toBinary(EdgeMessageSchema, this.template(kind, step)).length + PAD_SLACK;
      this.cache.set(key, size);
    }
    return size;
  }

  private template(kind: "upload" | "token", step: number): EdgeMessage {
    if (kind === "token") return encodeToken(step, U32_MAX);
    const [sparse, dense] = uploadTemplateValues(this.maxUpload, this.vocabSize);
    let largest: { ids?: Uint8Array; values: Uint8Array; dense?: boolean } = {
      ids: new Uint8Array(4 * sparse),
      values: new Uint8Array(4 * sparse),
    };
    // a sparse upload of n values costs 8n + 2 varints + 2 tags; a dense one 4 * vocab + its flag
    const sparseBytes = sparse ? 2 * (1 + varintSize(4 * sparse) + 4 * sparse) : 0;
    if (dense && 4 * this.vocabSize > sparseBytes) largest = { values: new Uint8Array(4 * this.vocabSize), dense: true };
    return create(EdgeMessageSchema, {
      kind: { case: "signal", value: { step: BigInt(step), signal: { case: "upload", value: largest }, noStop: true } },
    });
  }
}

/**
 * A serialised edge message padded to its public size: a step signal to that of the largest one the step may
 * send; the open, a full-row request and a close carry no private length and stay as they are.
 */
export function padEdgeMessage(message: EdgeMessage, bytes: Uint8Array, sizes: SignalSizes): Uint8Array {
  if (message.kind.case !== "signal") return bytes;
  const signal = message.kind.value;
  const step = Number(signal.step);
  if (signal.signal.case === "upload") {
    const values = signal.signal.value.values.length / 4;
    if (values > sizes.maxUpload) {
      throw new InvalidArgumentError(`an upload of ${values} values, more than the policy's public maximum ${sizes.maxUpload}`);
    }
    return padBytes(bytes, sizes.size("upload", step));
  }
  return padBytes(bytes, sizes.size("token", step));
}
