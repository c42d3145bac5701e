import { describe, expect, it } from "vitest";
import { certifiedFusedArgmax } from "../src/loop/certify.js";

// vocabulary of 6; the cloud sent ids [2, 0] (values .5, .3), every omitted id at most the tail bound.
// s(i) = .3 * p_llm(i) + .7 * u(i), worked by hand below.
describe("the cloud's greedy pick read off a sparse row and an upload", () => {
  it("certifies when the best known score beats the second and every omitted id's bound", () => {
    // upload u(0) = .4: s(0) = .09 + .28 = .37, s(2) = .15; omitted j <= .3 * .05 + .7 * 0 = .015 -> 0
    expect(certifiedFusedArgmax([2, 0], [0.5, 0.3], 0.05, [0], [0.4], 0.3, 6, new Set())).toBe(0);
  });

  it("refuses when an uploaded omitted id could still win", () => {
    // upload u(4) = .6 for an omitted id: its bound .3 * .05 + .7 * .6 = .435 > s(2) = .15 + .7 * .1 = .22
    expect(certifiedFusedArgmax([2, 0], [0.5, 0.3], 0.05, [2, 4], [0.1, 0.6], 0.3, 6, new Set())).toBeNull();
  });

  it("refuses a near tie within the rounding margin, and leaves excluded (stop) ids out of the choice", () => {
    // empty upload: s(2) = .15, s(0) = .09; with 2 excluded the best is 0, its rival the omitted bound .3 * .05
    expect(certifiedFusedArgmax([2, 0], [0.5, 0.3], 0.05, [], [], 0.3, 6, new Set([2]))).toBe(0);
    expect(certifiedFusedArgmax([2, 0], [0.5, 0.5], 0, [], [], 0.3, 2, new Set())).toBeNull(); // a tie
    expect(certifiedFusedArgmax([2], [0.5], 0.05, [], [], 0.3, 6, new Set([2]))).toBeNull(); // nothing allowed known
  });
});
