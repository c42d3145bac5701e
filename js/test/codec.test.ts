import { create, toBinary } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";
import { InvalidArgumentError } from "../src/core/errors.js";
import { CloudUpload } from "../src/policies/base.js";
import {
  DistributionSchema,
  EdgeMessageSchema,
  SignalSizes,
  decodeDistribution,
  encodeOpen,
  encodeToken,
  encodeUpload,
  padBytes,
  padEdgeMessage,
  paddingEntries,
  valuesToBytes,
  idsToBytes,
  idsFromBytes,
  valuesFromBytes,
} from "../src/wire/index.js";

const hex = (bytes: Uint8Array) => Buffer.from(bytes).toString("hex");
const upload = (ids: number[], values: number[]) => new CloudUpload(ids, values);
const padded = (message: ReturnType<typeof encodeToken>, sizes: SignalSizes) =>
  padEdgeMessage(message, toBinary(EdgeMessageSchema, message), sizes);

// the expected bytes below were written by Python's edge_sdk.protocol.wire (pad_edge_message, encode_open) for the same input
describe("the codec writes the bytes Python's edge_sdk.protocol.wire writes", () => {
  it("pads a token signal to the template of the longest token id", () => {
    const sizes = new SignalSizes(1536, 1536);
    expect(hex(padded(encodeToken(5, 7), sizes))).toBe("1204080518077a0400000000");
    expect(hex(padded(encodeToken(300, 262143), sizes))).toBe("120708ac0218ffff0f7a020000");
    // step 0 is left out of its template (proto3's default): a size cached for it must not serve step 1
    expect(padded(encodeToken(0, 7), sizes).length).toBe(10);
    expect(padded(encodeToken(1, 7), sizes).length).toBe(12);
  });

  it("pads an upload to the policy's largest, sparse or dense", () => {
    const small = encodeUpload(3, upload([2, 9], [0.5, 0.25]), 1536);
    const bytes = padded(small, new SignalSizes(1536, 100));
    expect(bytes.length).toBe(818);
    expect(hex(bytes).slice(0, 80)).toBe("1218080312140a08020000000900000012080000003f0000803e7a95060000000000000000000000");
    expect(padded(encodeUpload(3, upload([2, 9], [0.5, 0.25]), 1536, true), new SignalSizes(1536, 1536)).length).toBe(8018);
    expect(padded(encodeUpload(3, upload([2, 9], [0.5, 0.25]), 262144, true), new SignalSizes(262144, 262144)).length)
      .toBe(1048596);
  });

  it("encodes the open field for field", () => {
    const open = encodeOpen({
      promptIds: [2, 100, 5000], mode: "cloud", alpha: 0.3, space: "logit", temperature: 0, seed: 7n, maxNewTokens: 32,
      vocabFingerprint: Uint8Array.from([1, 2]), edgeModel: "gemma", vocabSize: 262144, topM: 256, resumePrefix: [],
      stopTokenIds: [1, 106], logprobs: false, topLogprobs: 0, jsonSchema: "", lookahead: 8, padded: true,
    });
    expect(hex(toBinary(EdgeMessageSchema, open))).toBe(
      "0a4508011a0e0a0c02000000640000008813000020012802359a99993e40074820520201025a0567656d6d616080801068800272007a0a0a08010000006a000000800108b80101",
    );
  });

  it("an upload of every id travels dense, values only", () => {
    const every = encodeUpload(0, upload([0, 1, 2], [0.5, 0.25, 0.25]), 3);
    const body = every.kind.case === "signal" && every.kind.value.signal.case === "upload" ? every.kind.value.signal.value : null;
    expect(body?.dense).toBe(true);
    expect(body?.ids.length).toBe(0);
  });
});

describe("arrays", () => {
  it("reads ids and values out of a Node Buffer that is a view into a larger pool", () => {
    const pool = Buffer.from("ffffffff0100000002000000", "hex").subarray(4); // Buffer.slice would not copy either
    expect(Array.from(idsFromBytes(pool))).toEqual([1, 2]);
    expect(Array.from(valuesFromBytes(Buffer.from("ffff0000803f", "hex").subarray(2)))).toEqual([1]);
  });
});

describe("padding", () => {
  it("entries add exactly the bytes asked for, where one entry's length prefix jumps (130 = 127 + 3)", () => {
    expect(paddingEntries(0)).toEqual([]);
    expect(paddingEntries(2)).toEqual([0]);
    expect(paddingEntries(129)).toEqual([127]); // 1 tag + 1 length + 127
    expect(paddingEntries(130)).toEqual([126, 0]); // 128 needs a 2-byte length (131 bytes): 126 + an empty entry
    expect(paddingEntries(131)).toEqual([128]);
    expect(() => paddingEntries(1)).toThrow(InvalidArgumentError);
  });

  it("appending entries to the bytes gives what protobuf-es writes with the padding field set", () => {
    for (const extra of [2, 3, 129, 130, 131, 16387, 16388]) {
      const message = encodeToken(9, 12345);
      const bytes = toBinary(EdgeMessageSchema, message);
      const withPadding = create(EdgeMessageSchema, message);
      withPadding.padding = paddingEntries(extra).map((n) => new Uint8Array(n));
      expect(hex(padBytes(bytes, bytes.length + extra))).toBe(hex(toBinary(EdgeMessageSchema, withPadding)));
    }
  });

  it("refuses an upload past the policy's public maximum", () => {
    expect(() => padded(encodeUpload(0, upload([1, 2, 3], [0.1, 0.1, 0.1]), 10), new SignalSizes(10, 2))).toThrow(/public maximum 2/);
  });
});

describe("distributions", () => {
  const sparse = (ids: number[], values: number[], tailBound: number, tailMass: number) =>
    create(DistributionSchema, { step: 4n, ids: idsToBytes(ids), values: valuesToBytes(values), tailBound, tailMass });

  it("fills omitted ids at min(tail bound, tail mass / omitted) in probability space", () => {
    const dist = decodeDistribution(sparse([3, 0], [0.5, 0.25], 0.25, 0.25), 6);
    expect(dist.publicFill(6, "prob")).toBeCloseTo(0.0625, 12); // 0.25 / 4 omitted, below the bound 0.25
    expect(Array.from(dist.filled(6, "prob"))).toEqual([0.25, 0.0625, 0.0625, 0.5, 0.0625, 0.0625]);
    expect(dist.topId()).toBe(3);
  });

  it("fills omitted logits at log(share) + log Z, log Z = logsumexp(sent) - log(1 - tail mass)", () => {
    // sent logits 0 and ln 3 hold 1 - 0.5 of the mass: Z = (1 + 3) / 0.5 = 8; share 0.5 / 2 omitted -> ln(0.25 * 8)
    const dist = decodeDistribution(sparse([1, 2], [Math.log(3), 0], 0, 0.5), 4);
    expect(dist.publicFill(4, "logit")).toBeCloseTo(Math.min(0, Math.log(2)), 6);
    const loose = decodeDistribution(sparse([1, 2], [Math.log(3), 0], -1, 0.5), 4);
    expect(loose.publicFill(4, "logit")).toBe(-1); // the bound caps it
  });

  it("refuses what Python refuses, with its messages", () => {
    expect(() => decodeDistribution(sparse([1, 1], [0.5, 0.4], 0.1, 0.1), 4)).toThrow("lists an id twice");
    expect(() => decodeDistribution(sparse([1, 2], [0.4, 0.5], 0.1, 0.1), 4)).toThrow("decreasing value");
    expect(() => decodeDistribution(sparse([1, 2], [0.5, 0.4], 0.45, 0.1), 4)).toThrow("tail bound exceeds");
    expect(() => decodeDistribution(sparse([1, 9], [0.5, 0.4], 0.1, 0.1), 4)).toThrow("outside the vocabulary");
    expect(() => decodeDistribution(sparse([1, 2], [NaN, 0.4], 0.1, 0.1), 4)).toThrow("non-finite");
    expect(() => decodeDistribution(create(DistributionSchema, { dense: valuesToBytes([1]) }), 4)).toThrow("1 entries");
  });


});
