/** Closed forms, the accountant and the labels, against independent references (scipy, hand-worked numbers,
 * Python's own formatting). */

import { describe, expect, it } from "vitest";
import { InvalidArgumentError, NotImplementedInTypeScriptError } from "../src/core/errors.js";
import { pyG, pyRepr } from "../src/core/format.js";
import { PrivacyAccountant, ReleaseEvent } from "../src/privacy/accountant.js";
import { erfc, invisibleInkClip, rdpEpsilon } from "../src/privacy/accounting.js";
import { PLD_DISCRETIZATION } from "../src/privacy/pld.js";
import { f64FromHex, loadVectors } from "./vectors.js";

const vectors = loadVectors();

describe("erfc", () => {
  // scipy.special.erfc at these points (an independent implementation)
  const reference: [number, number][] = [
    [-3.0, 1.9999779095030015], [-0.5, 1.5204998778130465], [0.0, 1.0], [0.1, 0.8875370839817152],
    [0.5, 0.4795001221869535], [1.0, 0.15729920705028516], [1.9, 0.007209570764742531],
    [2.0, 0.004677734981047266], [2.5, 0.00040695201744495886], [5.0, 1.5374597944280347e-12],
    [10.0, 2.0884875837625446e-45], [26.0, 5.663192408856145e-296],
  ];
  it.each(reference)("erfc(%s) agrees with scipy to 1e-14", (x, want) => {
    expect(Math.abs(erfc(x) - want) / want).toBeLessThan(1e-14);
  });
});

describe("the accountant", () => {
  it("converts Renyi-DP with the improved conversion (worked by hand)", () => {
    // 5 + log(1 - 1/2) - (log(1e-5) + log 2) / 1
    expect(rdpEpsilon(5, 2, 1e-5)).toBeCloseTo(5 - Math.LN2 + 5 * Math.LN10 - Math.LN2, 12);
  });

  it("composes pure DP at delta 0 by adding, and a heuristic to infinity from its first release", () => {
    const pure = new PrivacyAccountant(new ReleaseEvent("pure_dp", 2));
    pure.record(0, false);
    pure.record(1, false);
    expect(pure.epsilon()).toBe(4);
    expect(pure.accountant).toBe("basic composition (exact at delta 0)");
    const heuristic = new PrivacyAccountant(ReleaseEvent.nonPrivate("no guarantee"));
    expect(heuristic.epsilon()).toBe(0);
    heuristic.record(0, false); // not steered: no release
    expect(heuristic.epsilon()).toBe(0);
    heuristic.record(1, true);
    expect(heuristic.epsilon()).toBe(Infinity);
    expect(heuristic.summary().epsilon_spent).toBeNull();
  });

  it("withholds from the step where one more release would exceed max_epsilon, and from then on", () => {
    const accountant = new PrivacyAccountant(new ReleaseEvent("pure_dp", 1), { maxEpsilon: 2.5 });
    expect(accountant.withholds(0)).toBe(false);
    accountant.record(0, true);
    expect(accountant.withholds(1)).toBe(false);
    accountant.record(1, true);
    expect(accountant.withholds(2)).toBe(true); // a third release would spend 3 > 2.5
    expect(accountant.withholds(3)).toBe(true);
    expect(accountant.withheldFrom).toBe(2);
  });

  it("refuses a budget one release already exceeds, naming the working range", () => {
    expect(() => new PrivacyAccountant(new ReleaseEvent("pure_dp", 3), { maxEpsilon: 2 }))
      .toThrow(/max_epsilon 2 cannot be met: one release of this policy already spends epsilon 3 at delta 0/);
  });

  it("composes pure DP at a delta > 0 as dp-accounting's PLD accountant does (the Python ledger's golden figures)", () => {
    // Every figure within one grid step (1e-6) per release: the two atoms' losses +-log((1 - p/2) / (p/2)) are
    // rounded up to the 1e-6 grid, and at a round epsilon the exact loss lies on a grid point, so an ulp of
    // difference between Math.log/exp and the C library's can put an atom one step higher or lower there,
    // shifting the n-fold composition by up to n * 1e-6.  Elsewhere the figures agree to 1e-12 relative.
    let exact = 0;
    let total = 0;
    for (const row of vectors.pure_dp_at_delta) {
      const accountant = new PrivacyAccountant(new ReleaseEvent("pure_dp", f64FromHex(row.epsilon)),
        { delta: f64FromHex(row.delta) });
      expect(accountant.accountant).toBe("pld (dp-accounting)");
      for (const [n, hex] of row.epsilons) {
        const mine = accountant.epsilon(n);
        const python = f64FromHex(hex);
        total++;
        if (mine === python) exact++;
        expect(Math.abs(mine - python), `epsilon ${f64FromHex(row.epsilon)}, delta ${f64FromHex(row.delta)}, n ${n}`)
          .toBeLessThanOrEqual(n * PLD_DISCRETIZATION + 1e-12 * python);
      }
    }
    expect(total).toBe(60);
    console.log(`pure DP at delta > 0: ${exact} of ${total} figures equal Python's bit for bit`);
  });

  it("composes one pure DP release at a delta > 0 (worked by hand)", () => {
    // eps = 0.73 at delta 1e-7: two atoms, the loss L = 0.73 (730,000 grid steps) with mass P = e^L / (1 + e^L)
    // and -L with 1 - P; the scan from the top loss stops at the second atom, giving
    // eps = log((P - delta) / (P e^-L)) = L + log(1 - delta / P)
    const accountant = new PrivacyAccountant(new ReleaseEvent("pure_dp", 0.73), { delta: 1e-7 });
    const top = Math.exp(0.73) / (1 + Math.exp(0.73));
    expect(accountant.epsilon(1)).toBeCloseTo(0.73 + Math.log1p(-1e-7 / top), 12);
  });

  it("refuses at construction a horizon whose composition needs dp-accounting's dense PLD", () => {
    // epsilon 0.01: the composed PMF keeps about 16 standard deviations of a binomial, 500 atoms by n ~ 4,000
    expect(() => new PrivacyAccountant(new ReleaseEvent("pure_dp", 0.01), { delta: 1e-6, horizon: 5000 }))
      .toThrow(NotImplementedInTypeScriptError);
    expect(() => new PrivacyAccountant(new ReleaseEvent("pure_dp", 0.01), { delta: 1e-6, horizon: 256 })).not.toThrow();
  });

  it("composes zCDP releases as dp-accounting's RDP accountant does", () => {
    // dp_accounting.rdp.RdpAccountant(DEFAULT_RDP_ORDERS), ZCDpEvent(0.1) composed 1, 2, 3 times, at delta 1e-6
    const accountant = new PrivacyAccountant(new ReleaseEvent("zcdp", 0.1, { delta: 1e-6 }));
    const want = [2.143043523753668, 3.1310897749150355, 3.9200778582288445];
    want.forEach((epsilon, n) => expect(Math.abs(accountant.epsilon(n + 1) - epsilon) / epsilon).toBeLessThan(1e-12));
  });

  it("calibrates InvisibleInk's clip as Python does", () => {
    // edge_sdk.privacy.analysis.invisible_ink_clip(10.0, max_new_tokens=4, delta=1e-6, temperature=1.1)
    expect(Math.abs(invisibleInkClip(10, 4, 1e-6, 1.1) - 0.48251001340370414)).toBeLessThan(1e-12);
  });

  it("checks its event as Python does", () => {
    expect(() => new ReleaseEvent("gaussian", 0)).toThrow(InvalidArgumentError);
    expect(() => new ReleaseEvent("renyi", 1)).toThrow(/Renyi order must be finite and > 1/);
    expect(() => new ReleaseEvent("non_private", 1)).toThrow(/infinite epsilon/);
  });
});

describe("Python's number formats", () => {
  // what Python prints for these (repr, format(x, ".4g"), format(x, "g"))
  const values = [1.0, 0.05, 1e-5, 3.0000000000000004e-05, 2.0, 256.0, 1e16, 1.5e16, 123456789.0, 0.0001,
    0.00012345, 12.13, 1e-6, 0.30000000000000004, 100.0, 1e22];
  it("writes repr", () => {
    expect(values.map((v) => pyRepr(v))).toEqual(["1.0", "0.05", "1e-05", "3.0000000000000004e-05", "2.0", "256.0",
      "1e+16", "1.5e+16", "123456789.0", "0.0001", "0.00012345", "12.13", "1e-06", "0.30000000000000004", "100.0",
      "1e+22"]);
  });
  it("writes .4g and g", () => {
    expect(values.map((v) => pyG(v, 4))).toEqual(["1", "0.05", "1e-05", "3e-05", "2", "256", "1e+16", "1.5e+16",
      "1.235e+08", "0.0001", "0.0001234", "12.13", "1e-06", "0.3", "100", "1e+22"]);
    expect(values.map((v) => pyG(v))).toEqual(["1", "0.05", "1e-05", "3e-05", "2", "256", "1e+16", "1.5e+16",
      "1.23457e+08", "0.0001", "0.00012345", "12.13", "1e-06", "0.3", "100", "1e+22"]);
  });
});
