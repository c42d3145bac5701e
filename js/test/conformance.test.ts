/**
 * The TypeScript decide step replays the Python SDK's golden vectors (tests/conformance/vectors.json, written by
 * `python -m tests.conformance.write_vectors` through the Python decoder): the same withheld steps, full-row
 * requests, uploaded ids and float32 values, synced tokens, exposure sets, steered and released steps, epsilons,
 * leakage shares and ledger summaries, for every registered policy in every mode and space Python
 * defines it in, each case fed the very uniform draws Python's policy consumed.
 *
 * Edge-side cases also replay each token's log-probabilities read off the fused row (`tokenLogprobs`).
 *
 * Bit for bit, DP-Logit's noised uploads and every policy's release event included, except the log-probabilities
 * (within LOGPROB_ULPS float64 ulps: see checkLogprobs) and the epsilons of the
 * Gaussian composition (erfc inside a bisection) and of zCDP (log at every RDP order): there this runtime's
 * transcendental functions stand in for the C library's, and the figures agree to 1e-14 relative.
 */

import { describe, expect, it } from "vitest";
import { CloudDistribution } from "../src/core/distribution.js";
import { StepDecider } from "../src/core/decide.js";
import { NotImplementedInTypeScriptError, UnknownNameError } from "../src/core/errors.js";
import { TableSLM } from "./scripted.js";
import { softmax, type Draws } from "../src/core/fusion.js";
import { tokenLogprobs, type TokenLogprobs } from "../src/core/logprobs.js";
import {
  CloudUpload, EmbeddingNeighbours, makePolicy, registeredPolicies, SyncedToken,
} from "../src/policies/index.js";
import { LeakageMeter } from "../src/privacy/ledger.js";
import { maskProbabilities } from "../src/privacy/masking.js";
import { type CaseJson, type DistJson, f32FromHex, f32ToHex, f64FromHex, f64ToHex, loadVectors, ReplayDraws }
  from "./vectors.js";

const vectors = loadVectors();

/** Relative distance of two float64s (0 when equal). */
function relative(a: number, b: number): number {
  if (a === b) return 0;
  return Math.abs(a - b) / Math.max(Math.abs(a), Math.abs(b));
}

/** Distance in float32 units in the last place (both finite). */
function ulps(a: number, b: number): number {
  const view = new DataView(new ArrayBuffer(8));
  const ordered = (x: number): number => {
    view.setFloat32(0, x, true);
    const bits = view.getInt32(0, true);
    return bits < 0 ? -(bits & 0x7fffffff) : bits;
  };
  return Math.abs(ordered(a) - ordered(b));
}

function distribution(step: number, json: DistJson): CloudDistribution {
  if (json.dense !== undefined) return CloudDistribution.full(step, f32FromHex(json.dense));
  return new CloudDistribution(step, Int32Array.from(json.ids ?? []), f32FromHex(json.values ?? ""),
    f64FromHex(json.tail_bound ?? ""), f64FromHex(json.tail_mass ?? ""));
}

/** Epsilons found by bisection (the Gaussian composition on erfc) or through log at every RDP order (zCDP). */
const bisected = (c: CaseJson): boolean => c.event.kind === "gaussian" || c.event.kind === "zcdp";
/** Such epsilons agree to this relative distance (the largest seen: 1.1e-15). */
const EPSILON_RELATIVE = 1e-14;

/** The largest distance seen between a log-probability here and Python's, in float64 ulps (see checkLogprobs). */
let worstLogprobUlps = 0;

/** Distance in float64 units in the last place (equal infinities: 0). */
function ulps64(a: number, b: number): number {
  if (a === b) return 0;
  const view = new DataView(new ArrayBuffer(16));
  view.setFloat64(0, a);
  view.setFloat64(8, b);
  const ordered = (at: number): bigint => {
    const bits = view.getBigInt64(at);
    return bits < 0n ? -(bits & 0x7fffffffffffffffn) : bits;
  };
  const d = ordered(0) - ordered(8);
  return Number(d < 0n ? -d : d);
}

/**
 * Edge-side log-probabilities against Python's: the same top ids in the same order, and every value within
 * LOGPROB_ULPS float64 ulps (-inf exactly).  Not bit for bit: `log q_i = log f_i - log sum f` (logit space
 * `z_i - top - log sum exp(z - top)`) goes through `Math.log`/`Math.exp` here and numpy's (the C library's or its
 * SIMD) there, each within an ulp of the true value; the sums are numpy's pairwise order exactly.
 */
function checkLogprobs(mine: TokenLogprobs, want: { logprob: string; top: [number, string][] }, where: string): void {
  const python = f64FromHex(want.logprob);
  expect(Number.isFinite(mine.logprob), `${where} logprob finite`).toBe(Number.isFinite(python));
  expect(mine.top.map(([id]) => id), `${where} top ids`).toEqual(want.top.map(([id]) => id));
  const pairs: [number, number][] = [[mine.logprob, python], ...mine.top.map(([, v], j) => [v, f64FromHex(want.top[j][1])] as [number, number])];
  for (const [a, b] of pairs) {
    const d = ulps64(a, b);
    worstLogprobUlps = Math.max(worstLogprobUlps, d);
    expect(d, `${where} log-probability ${a} vs Python's ${b}`).toBeLessThanOrEqual(LOGPROB_ULPS);
  }
}
/** The largest distance seen (4: one ulp apart in `log f_i` and `log sum f` grows where the two nearly cancel). */
const LOGPROB_ULPS = 4;

function replay(c: CaseJson): void {
  const neighbours = c.embeddings === null ? {} : {
    neighbours: new EmbeddingNeighbours(f32FromHex(c.embeddings.values), c.embeddings.rows, c.embeddings.dim),
  };
  const policy = makePolicy(c.policy, { ...c.params, ...neighbours });
  expect(policy.describe()).toBe(c.describe);
  const step: { draws: ReplayDraws } = { draws: new ReplayDraws([]) };
  const draws: Draws = { random: () => step.draws.random(), randomRaw: (n) => step.draws.randomRaw(n) };
  const decider = new StepDecider(policy, {
    mode: c.mode, alpha: f64FromHex(c.alpha), maxNewTokens: c.max_new_tokens, exposureK: c.exposure_k,
    exposureBudget: c.exposure_budget, maxEpsilon: c.max_epsilon, epsilonDelta: c.epsilon_delta,
  }, c.vocab_size, c.masked_ids, draws);
  const event = decider.accountant.event;
  expect(event.kind).toBe(c.event.kind);
  expect(f64ToHex(event.delta)).toBe(c.event.delta);
  expect(f64ToHex(event.value)).toBe(c.event.value);
  const meter = new LeakageMeter(new Set(c.private_content_ids));
  const maxSteps = c.steps.length;
  c.steps.forEach((row, t) => {
    const want = row.expect;
    step.draws = new ReplayDraws(row.draws);
    const withheld = decider.withholds(t, maxSteps);
    expect(withheld, `step ${t} withheld`).toBe(want.withheld);
    const slmRow = c.space === "prob"
      ? maskProbabilities(f32FromHex(row.slm_probs as string), decider.masked)
      : decider.view(f32FromHex(row.slm_logits));
    let dist = distribution(t, row.cloud);
    const stops = row.no_stop ? c.stop_ids : null;
    let decision = decider.decide(slmRow, dist, withheld, stops);
    expect(decision === null, `step ${t} asks for the full row`).toBe(want.full_requested);
    if (decision === null) {
      dist = CloudDistribution.full(t, f32FromHex(row.full as string));
      decision = decider.decide(slmRow, dist, withheld, stops);
    }
    if (decision === null) throw new Error("a full row must decide");
    if (!withheld) decider.recordRelease(t, decision.signal, dist);
    const signal = decision.signal;
    if (want.signal === "upload") {
      if (!(signal instanceof CloudUpload)) throw new Error(`step ${t}: expected an upload`);
      expect(Array.from(signal.ids), `step ${t} uploaded ids`).toEqual(want.ids);
      expect(f32ToHex(signal.values), `step ${t} uploaded values`).toBe(want.values);
    } else {
      if (!(signal instanceof SyncedToken)) throw new Error(`step ${t}: expected a token`);
      expect(signal.tokenId, `step ${t} token`).toBe(want.token_id);
    }
    if (want.logprobs !== undefined) {
      if (!(signal instanceof SyncedToken) || c.logprobs === null) throw new Error(`step ${t}: logprobs of no token`);
      checkLogprobs(tokenLogprobs(decision.fused(), c.space, signal.tokenId, c.logprobs), want.logprobs, `step ${t}`);
    }
    expect(decision.exposure, `step ${t} exposure`).toEqual(want.exposure);
    meter.observe(decision.exposure);
    if (signal instanceof SyncedToken) meter.observe([signal.tokenId]);
    expect(decider.countSteered(signal, dist), `step ${t} steered`).toBe(want.steered);
    expect(decider.accountant.releaseSteps.includes(t), `step ${t} released`).toBe(want.released);
    const epsilon = f64FromHex(want.epsilon);
    expect(relative(decider.accountant.epsilon(), epsilon), `step ${t} epsilon`)
      .toBeLessThanOrEqual(bisected(c) ? EPSILON_RELATIVE : 0);
    const source = decider.accountant.sourceEpsilon();
    expect(source === null ? null : f64ToHex(source)).toBe(want.source_epsilon);
    expect(f64ToHex(meter.share), `step ${t} leak share`).toBe(want.leak_share);
    expect(step.draws.finished, `step ${t} took every draw Python took`).toBe(true);
  });
  const summary = decider.accountant.summary();
  expect(decider.accountant.releaseSteps).toEqual(c.expect.release_steps);
  expect(summary.withheld_from).toBe(c.expect.withheld_from);
  expect(summary.guarantee).toBe(c.expect.guarantee);
  expect(summary.accountant).toBe(c.expect.accountant);
  expect(summary.event).toBe(c.expect.event);
  expect(f64ToHex(summary.delta)).toBe(c.expect.delta);
  if (c.expect.epsilon_spent === null) expect(summary.epsilon_spent).toBeNull();
  else expect(relative(summary.epsilon_spent as number, f64FromHex(c.expect.epsilon_spent))).toBeLessThanOrEqual(
    bisected(c) ? EPSILON_RELATIVE : 0);
  expect(decider.budget.steeredSteps).toBe(c.expect.steered_steps);
}

describe("golden vectors from the Python SDK", () => {
  it("are the format this replay reads, and cover every registered policy", () => {
    expect(vectors.format).toBe("coveil-conformance/1");
    expect([...new Set(vectors.cases.map((c) => c.policy))].sort()).toEqual(registeredPolicies());
    // what is replayed: every mode and space of every policy, with every kind of step in it
    const combos = new Set(vectors.cases.map((c) => `${c.policy}/${c.mode}/${c.space}`));
    expect([...combos].sort()).toEqual([
      "cogenesis/cloud/prob", "coveil/cloud/logit", "coveil/cloud/prob", "coveil/edge/logit", "coveil/edge/prob",
      "custext/edge/prob",
      "dp_fusion/cloud/prob", "dp_fusion/edge/prob", "dp_logit/cloud/prob", "invisible_ink/edge/prob", "ldp_sampler/edge/prob",
      "undefended/cloud/logit", "undefended/cloud/prob", "undefended/edge/logit",
      "undefended/edge/prob",
    ]);
    const steps = vectors.cases.flatMap((c) => c.steps.map((s) => s.expect));
    for (const flag of ["withheld", "full_requested", "steered", "released"] as const) {
      expect(steps.some((s) => s[flag]) && steps.some((s) => !s[flag]), flag).toBe(true);
    }
  });

  it.each(vectors.cases.map((c) => [c.name, c] as const))("%s replays bit for bit (log-probabilities to LOGPROB_ULPS)",
    (_name, c) => replay(c));

  it("replayed edge-side log-probabilities within LOGPROB_ULPS of Python's", () => {
    const edge = vectors.cases.filter((c) => c.mode === "edge");
    expect(edge.every((c) => c.steps.every((s) => s.expect.logprobs !== undefined))).toBe(true);
    expect(edge.some((c) => c.space === "logit") && edge.some((c) => c.space === "prob")).toBe(true);
    console.log(`edge-side log-probabilities: at most ${worstLogprobUlps} float64 ulps from Python's`);
  });

  it("refuses an unknown policy and a parameter a policy does not have, by name", () => {
    expect(() => makePolicy("coveill")).toThrow(UnknownNameError);
    expect(() => makePolicy("coveil", { lamda: 1 })).toThrow(/policy coveil has no parameter 'lamda'/);
    expect(() => makePolicy("coveil", { k: 2.5 })).toThrow(/coveil parameter k must be an integer, got 2.5/);
    expect(() => makePolicy("dp_logit", { epsilon: true })).toThrow(/must be a number/);
  });

  it("CusText over a backend's own embeddings (Python's make_policy('custext', backend=slm)) is UNIMPLEMENTED here", () => {
    const backend = new TableSLM([[0, 1, 2, 3]]);
    let error: unknown;
    try {
      makePolicy("custext", {}, backend);
    } catch (caught) {
      error = caught;
    }
    expect(error).toBeInstanceOf(NotImplementedInTypeScriptError);
    expect((error as NotImplementedInTypeScriptError).code).toBe("UNIMPLEMENTED");
    expect(makePolicy("coveil", { lam: 1 }, backend).name).toBe("coveil"); // the others take nothing from it
  });

  it("computes the SLM's probabilities from its logits bit for bit as Python's softmax does", () => {
    let worst = 0;
    for (const c of vectors.cases) {
      for (const row of c.steps) {
        if (row.slm_probs === undefined) continue;
        const mine = softmax(f32FromHex(row.slm_logits));
        const python = f32FromHex(row.slm_probs);
        mine.forEach((value, i) => { worst = Math.max(worst, ulps(value, python[i])); });
      }
    }
    expect(worst).toBe(0); // both round a float64 exp once to float32, and sum in numpy's pairwise order
  });
});
