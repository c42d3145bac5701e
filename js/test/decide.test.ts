/** The decide step's own rules and the ledger's words, on rows small enough to work by hand. */

import { describe, expect, it } from "vitest";
import { StepDecider } from "../src/core/decide.js";
import { CloudDistribution } from "../src/core/distribution.js";
import { InvalidArgumentError, NonFiniteError } from "../src/core/errors.js";
import { osDraws } from "../src/core/fusion.js";
import { CoGenesis, CoVeil, SyncedToken, Undefended } from "../src/policies/index.js";

describe("the decide step", () => {
  it("refuses a policy in a mode it does not define", () => {
    expect(() => new StepDecider(new CoGenesis(), { mode: "edge" }, 4)).toThrow(
      "policy 'cogenesis' does not support edge-side fusion");
  });

  it("refuses SLM logits holding NaN before any policy reads them", () => {
    const decider = new StepDecider(new CoVeil(), { mode: "edge" }, 3);
    expect(() => decider.view(Float32Array.of(0, NaN, 1))).toThrow(NonFiniteError);
    expect(() => new StepDecider(new CoVeil(), { mode: "edge" }, 3, [5])).toThrow(InvalidArgumentError);
  });

  it("keeps an end id out of the choice on a no_stop step, edge-side", () => {
    // undefended greedy: fused = 0.3 * p_llm + 0.7 * p_slm; id 0 wins unless it is a stop id, then id 1
    const decider = new StepDecider(new Undefended(), { mode: "edge", exposureK: 1 }, 3);
    const dist = CloudDistribution.full(0, Float32Array.of(0.6, 0.3, 0.1));
    const slm = Float32Array.of(0.5, 0.4, 0.1);
    expect((decider.decide(slm, dist, false)?.signal as SyncedToken).tokenId).toBe(0);
    expect((decider.decide(slm, dist, false, [0])?.signal as SyncedToken).tokenId).toBe(1);
    // withheld: the cloud's own top, or its best allowed id
    expect((decider.decide(slm, dist, true, [0])?.signal as SyncedToken).tokenId).toBe(1);
  });

  it("words a heuristic's ledger with counts, as Python does", () => {
    const decider = new StepDecider(new CoVeil(), { mode: "edge", exposureK: 1 }, 3);
    decider.accountant.record(0, true);
    decider.ledger.entries.push({
      step: 0, token_id: 1, policy: decider.ledger.policy, signal: "token", values_uploaded: 0, full_requested: false,
      withheld: false, steered: true, bytes_up: 10, bytes_down: 20, leak_share: 0, edge_ms: 1, wait_ms: 1,
      cloud_forward_ms: 1, exposure: [0], sends: 1, full_requests: 0, pace_overrun: false,
    });
    expect(decider.ledger.policy).toBe("coveil(lam=1.0, k=50)");
    expect(decider.ledger.inWords()).toBe(
      "no DP guarantee (a heuristic): 1 of 1 steps revealed 1 values decided by your private context");
  });
});

describe("draws from the operating system", () => {
  it("hands out uniforms in [0, 1) and as many raw words as asked, beyond one getRandomValues call", () => {
    for (let i = 0; i < 1000; i++) {
      const u = osDraws.random();
      expect(u >= 0 && u < 1).toBe(true);
    }
    const words = osDraws.randomRaw(20000);
    expect(words.length).toBe(20000);
    expect(words.subarray(16384).some((word) => word !== 0n)).toBe(true); // the last chunk was filled too
  });
});
