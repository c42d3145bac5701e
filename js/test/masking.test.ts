/**
 * `never_upload` over a token table: the ids the TypeScript SDK masks for each span, and the spans it refuses,
 * are exactly the Python SDK's (tests/conformance/vectors.json, "masking"), with the table tokenised as Python's
 * TableSLM does (the longest piece at each position, the first such piece on ties).
 */

import { describe, expect, it } from "vitest";
import { InvalidArgumentError } from "../src/core/errors.js";
import { FLOAT32_LOWEST } from "../src/core/fusion.js";
import { foldedVocabulary, maskLogits, maskProbabilities, neverUploadIds } from "../src/privacy/masking.js";
import { loadVectors } from "./vectors.js";

function tableTokenizer(pieces: string[]): (text: string) => number[] {
  return (text) => {
    const ids: number[] = [];
    let at = 0;
    while (at < text.length) {
      let best = -1;
      pieces.forEach((piece, id) => {
        if (piece && text.startsWith(piece, at) && (best < 0 || piece.length > pieces[best].length)) best = id;
      });
      if (best < 0) throw new Error(`no piece of the vocabulary matches '${text.slice(at, at + 20)}'`);
      ids.push(best);
      at += pieces[best].length;
    }
    return ids;
  };
}

describe("never_upload masking", () => {
  const tables = loadVectors().masking;

  it.each(tables.flatMap((table) => table.cases.map((c) => [c.spans.join(" | "), table, c] as const)))(
    "masks the ids Python masks for %s",
    (_label, table, c) => {
      const piece = (id: number): string => table.pieces[id];
      const vocabulary = foldedVocabulary(piece, table.pieces.length);
      const ids = neverUploadIds(c.spans, table.private_context, tableTokenizer(table.pieces), piece, vocabulary);
      expect([...ids].sort((x, y) => x - y)).toEqual(c.ids);
    },
  );

  it.each(tables.flatMap((table) => table.errors.map((e) => [JSON.stringify(e.spans), table, e] as const)))(
    "refuses %s with Python's message",
    (_label, table, e) => {
      const piece = (id: number): string => table.pieces[id];
      const call = (): Set<number> =>
        neverUploadIds(e.spans, table.private_context, tableTokenizer(table.pieces), piece,
          foldedVocabulary(piece, table.pieces.length));
      expect(call).toThrow(InvalidArgumentError);
      expect(call).toThrow(e.error);
    },
  );

  it("zeroes masked probabilities and renormalises the rest by their float64 sum (worked by hand)", () => {
    // 0.5 + 0.25 + 0.25 with id 0 masked: the rest sum to 0.5, each becomes 0.5
    const p = maskProbabilities(Float32Array.from([0.5, 0.25, 0.25]), [0]);
    expect(Array.from(p)).toEqual([0, 0.5, 0.5]);
  });

  it("lowers masked logits to float32's minimum and leaves the row it was given alone", () => {
    const z = Float32Array.from([1, 2, 3]);
    expect(Array.from(maskLogits(z, [2]))).toEqual([1, 2, FLOAT32_LOWEST]);
    expect(Array.from(z)).toEqual([1, 2, 3]);
  });
});
