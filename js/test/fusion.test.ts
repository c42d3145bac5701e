/** TopK, its membership test and the float32 fusion, against a plain full sort and hand-worked numbers. */

import { describe, expect, it } from "vitest";
import { fuse, inTopK, sumFloat32, topKIds } from "../src/core/fusion.js";

/** Ids by decreasing value, ties to the lower id, by sorting everything (the reference). */
function reference(values: Float32Array): number[] {
  return Array.from(values.keys()).sort((x, y) => (values[y] > values[x] ? 1 : values[y] < values[x] ? -1 : x - y));
}

/** Rows with many exact ties: values drawn from a few levels (a seeded generator). */
function rows(count: number): Float32Array[] {
  let state = 12345;
  const next = (): number => {
    state = (Math.imul(state, 1103515245) + 12345) >>> 0;
    return state / 2 ** 32;
  };
  return Array.from({ length: count }, () => {
    const n = 1 + Math.floor(next() * 300);
    const levels = 1 + Math.floor(next() * 20);
    return Float32Array.from({ length: n }, () => Math.floor(next() * levels) / levels);
  });
}

describe("TopK", () => {
  it("equals a full sort, ties to the lower id, for every k", () => {
    for (const values of rows(200)) {
      const sorted = reference(values);
      for (const k of [1, 2, 3, 7, 50, values.length, values.length + 5]) {
        expect(topKIds(values, k)).toEqual(sorted.slice(0, k));
      }
    }
  });

  it("says whether an id is in TopK exactly when the full sort puts it there", () => {
    for (const values of rows(100)) {
      const rank = new Map(reference(values).map((id, at) => [id, at]));
      for (const k of [1, 3, 10, 50]) {
        for (let i = 0; i < values.length; i++) expect(inTopK(values, i, k)).toBe((rank.get(i) as number) < k);
      }
    }
  });
});

describe("float32 fusion", () => {
  it("rounds each product and the sum to float32 as numpy does", () => {
    // 0.3 * 0.1 + 0.7 * 0.2 in float32 (numpy: np.float32(0.3) * np.float32(0.1) + np.float32(0.7) * np.float32(0.2))
    const fused = fuse(Float32Array.of(0.1), Float32Array.of(0.2), 0.3);
    expect(fused[0]).toBe(Math.fround(Math.fround(Math.fround(0.3) * Math.fround(0.1)) +
      Math.fround(Math.fround(0.7) * Math.fround(0.2))));
    expect(fused[0]).toBe(0.17000000178813934); // numpy's float32 result, printed as a float64
  });

  it("sums float32 rows pairwise as numpy does", () => {
    // 1 + 2^-24 added 16 times: a sequential float32 sum stays at 1 (each 2^-24 rounds away), numpy's eight running
    // sums keep 1 in one of them and collect the small ones in the other seven and in pairs
    const values = Float32Array.from({ length: 17 }, (_, i) => (i === 0 ? 1 : 2 ** -24));
    expect(sumFloat32(values)).toBe(1.0000009536743164); // np.sum of this array
  });
});
