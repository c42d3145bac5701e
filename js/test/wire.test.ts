import { create, toBinary, fromBinary } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";
import { EdgeMessageSchema, StepSignalSchema } from "../src/wire/index.js";

describe("generated wire", () => {
  it("encodes a StepSignal carrying a token as the protobuf bytes worked by hand", () => {
    const signal = create(StepSignalSchema, { step: 5n, signal: { case: "tokenId", value: 300 } });
    // field 1 varint 5: 08 05; field 3 varint 300 = 0xAC 0x02: 18 AC 02
    expect(Array.from(toBinary(StepSignalSchema, signal))).toEqual([0x08, 0x05, 0x18, 0xac, 0x02]);
  });

  it("decodes an EdgeMessage it encoded", () => {
    const message = create(EdgeMessageSchema, {
      kind: { case: "signal", value: { step: 2n, signal: { case: "tokenId", value: 7 } } },
    });
    const decoded = fromBinary(EdgeMessageSchema, toBinary(EdgeMessageSchema, message));
    expect(decoded.kind.case).toBe("signal");
  });
});
