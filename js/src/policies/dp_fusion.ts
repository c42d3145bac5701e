/**
 * DP-Fusion (Thareja et al., ICLR 2026) in both fusion modes: the private distribution mixed towards the public
 * one by the largest weight whose mixture stays within `b` of it at the Renyi orders that bound any two private
 * contexts (Python: `edge_sdk.policies.dp_fusion`).
 *
 * The sums run in float64 as Python's; Python's `np.sum` is numpy's pairwise sum (reproduced), its dot products
 * are einsum's (here in order), so a mixing weight can differ from Python's in its last bits.
 */

import { type Draws, pairwiseSum, sampleIndex, topKIds } from "../core/fusion.js";
import { InvalidArgumentError } from "../core/errors.js";
import { ReleaseEvent } from "../privacy/accountant.js";
import {
  checkDelta, checkEpsilon, checkOrder, checkPositiveInt, dpFusionBound, dpFusionPairRdp, rdpEpsilon,
} from "../privacy/accounting.js";
import { CloudUpload, type Described, type FusionMode, Policy, requireDraws, SyncedToken } from "./base.js";

const f32 = Math.fround;

/** DP-Fusion's floor on probabilities: both rows are floored and renormalised before they are bounded and drawn. */
export const RENYI_PROBABILITY_FLOOR = 1e-10;
/** The largest Renyi order DP-Fusion takes (its bound is checked at 2a). */
export const MAX_ORDER = 8.0;
const WEIGHT_TOLERANCE = 1e-12;
const SLACK_TOLERANCE = 1e-12;
const WEIGHT_STEPS = 300;

const sum64 = (row: Float64Array): number => pairwiseSum(row, 0, row.length, false);

function binomial(n: number, k: number): number {
  let value = 1;
  for (let j = 1; j <= k; j++) value = (value * (n - k + j)) / j;
  return Math.round(value);
}

/**
 * Largest `l` in `[0, high]` with `total(l) <= limit`, given `total(0) = base <= limit` and `total` convex: `high`
 * if feasible, else Illinois regula falsi on `f(l) = limit / total(l) - 1` with a bisection step after two steps
 * that do not halve the bracket; the feasible end once the bracket is 1e-12 relative (or a feasible point leaves
 * less than 1e-12 of the slack).  The result never exceeds the bound.
 */
function largestFeasible(total: (weight: number) => number, base: number, limit: number, start: number): number {
  let high = start;
  let value = total(high);
  if (value <= limit) return high;
  let low = 0;
  let fLow = limit / base - 1;
  let fHigh = limit / value - 1;
  let side = 0;
  let slow = 0;
  for (let step = 0; step < WEIGHT_STEPS; step++) {
    const width = high - low;
    if (width <= WEIGHT_TOLERANCE * high) break;
    let guess = high - (fHigh * (high - low)) / (fHigh - fLow);
    if (slow >= 2 || !(low < guess && guess < high)) {
      guess = 0.5 * (low + high);
      slow = 0;
    }
    value = total(guess);
    const fGuess = limit / value - 1;
    if (value <= limit) {
      if (limit - value <= SLACK_TOLERANCE * (limit - base)) return guess;
      low = guess;
      fLow = fGuess;
      if (side === -1) fHigh *= 0.5;
      side = -1;
    } else {
      high = guess;
      fHigh = fGuess;
      if (side === 1) fLow *= 0.5;
      side = 1;
    }
    slow = high - low > 0.5 * width ? slow + 1 : 0;
  }
  return low;
}

/**
 * One step's floored rows and the two convex constraints of the mixing weight:
 * `p~ = max(p_priv / sum, 1e-10)`, `q~ = max(p_pub / sum, 1e-10)` on the public support, renormalised; the weight
 * is `max{l : D_2a(m_l||q~) <= b and D_(2a-1)(q~||m_l) <= b}`, `m_l = l p~ + (1 - l) q~`.
 */
class Mixing {
  readonly forwardOrder: number;
  readonly reverseOrder: number;
  readonly privateRow: Float64Array;
  readonly publicRow: Float64Array;
  readonly ids: Int32Array | null;
  readonly direction: Float64Array;
  readonly base: number;
  trivial: number | null = null;
  private forwardLimit = 0;
  private reverseLimit = 0;
  private coefficients: number[] | null = null;

  constructor(pPrivate: Float32Array, pPublic: Float32Array, bound: number, order: number) {
    checkOrder(order);
    this.forwardOrder = 2 * order;
    this.reverseOrder = 2 * order - 1;
    if (pPrivate.length !== pPublic.length) {
      throw new InvalidArgumentError(`private and public distributions must be 1-D of one length, got (${
        pPrivate.length},) and (${pPublic.length},)`);
    }
    let supported = 0;
    for (let i = 0; i < pPublic.length; i++) if (pPublic[i] > 0) supported++;
    if (supported === pPublic.length) {
      this.ids = null;
    } else {
      this.ids = new Int32Array(supported);
      for (let i = 0, at = 0; i < pPublic.length; i++) if (pPublic[i] > 0) this.ids[at++] = i;
    }
    const floored = (source: Float32Array, what: string): Float64Array => {
      const row = this.ids === null ? Float64Array.from(source) : Float64Array.from(this.ids, (i) => source[i]);
      const total = this.ids === null ? sum64(row) : pairwiseSum(source, 0, source.length, false);
      if (!(total > 0 && Number.isFinite(total))) {
        throw new InvalidArgumentError(`the ${what} distribution needs a positive finite mass, got ${total}`);
      }
      const floor = RENYI_PROBABILITY_FLOOR * total;
      for (let i = 0; i < row.length; i++) row[i] = Math.max(row[i], floor);
      const mass = sum64(row);
      for (let i = 0; i < row.length; i++) row[i] /= mass;
      return row;
    };
    this.privateRow = floored(pPrivate, "private");
    this.publicRow = floored(pPublic, "public");
    this.direction = new Float64Array(this.privateRow.length);
    for (let i = 0; i < this.direction.length; i++) this.direction[i] = this.privateRow[i] - this.publicRow[i];
    this.base = sum64(this.publicRow);
    const size = this.publicRow.length;
    if (!(bound > 0)) {
      this.trivial = 0;
      return;
    }
    if (bound >= Math.log((1 + size * RENYI_PROBABILITY_FLOOR) / RENYI_PROBABILITY_FLOOR)) {
      this.trivial = 1;
      return;
    }
    const forwardExponent = (this.forwardOrder - 1) * bound;
    if (forwardExponent >= 700) {
      throw new InvalidArgumentError(`DP-Fusion's Renyi order ${order} is too large for float64 sums at bound ${bound}`);
    }
    this.forwardLimit = Math.exp(forwardExponent);
    this.reverseLimit = Math.exp((this.reverseOrder - 1) * bound);
    if (this.base > this.reverseLimit) this.trivial = 0;
  }

  /** One id drawn from `p~` (`fromPrivate`) or `q~`. */
  draw(fromPrivate: boolean, draws: Draws): number {
    const index = sampleIndex(fromPrivate ? this.privateRow : this.publicRow, draws);
    return this.ids === null ? index : this.ids[index];
  }

  /** Whether `weight <= lambda` (feasible), without solving for `lambda`; most are rejected by the chi^2 test. */
  allows(weight: number): boolean {
    if (this.trivial !== null) return weight <= this.trivial;
    if (weight > 1) return false;
    let chi2 = 0; // sum (d / q) * d, in order
    for (let i = 0; i < this.direction.length; i++) chi2 += (this.direction[i] / this.publicRow[i]) * this.direction[i];
    if ((this.forwardOrder - 1) * Math.log1p(weight * weight * chi2) > Math.log(this.forwardLimit)) return false;
    return this.forward(weight) <= this.forwardLimit && this.reverse(weight) <= this.reverseLimit;
  }

  /** `lambda`: the forward root, lowered to the reverse constraint's root when that binds. */
  weight(): number {
    if (this.trivial !== null) return this.trivial;
    const forward = largestFeasible((w) => this.forward(w), this.base, this.forwardLimit, 1.0);
    if (forward === 0) return forward;
    return largestFeasible((w) => this.reverse(w), this.base, this.reverseLimit, forward);
  }

  private forward(weight: number): number {
    if (this.forwardOrder === Math.trunc(this.forwardOrder)) return this.forwardPolynomial(weight);
    let sum = 0;
    for (let i = 0; i < this.publicRow.length; i++) {
      const mixture = this.publicRow[i] + weight * this.direction[i];
      sum += (mixture / this.publicRow[i]) ** (this.forwardOrder - 1) * mixture;
    }
    return sum;
  }

  /** `F(l) = sum_k C(n, k) l^k s_k`, `s_k = sum d^k q^(1-k)` (`n = 2a`; the sums read once). */
  private forwardPolynomial(weight: number): number {
    if (this.coefficients === null) {
      const n = this.forwardOrder;
      const ratio = new Float64Array(this.direction.length);
      for (let i = 0; i < ratio.length; i++) ratio[i] = this.direction[i] / this.publicRow[i];
      const term = Float64Array.from(this.direction);
      const sums = [this.base, sum64(this.direction)];
      for (let k = 2; k <= n; k++) {
        for (let i = 0; i < term.length; i++) term[i] *= ratio[i];
        sums.push(sum64(term));
      }
      this.coefficients = sums.map((s, k) => binomial(n, k) * s);
    }
    let total = 0;
    for (let k = this.coefficients.length - 1; k >= 0; k--) total = total * weight + this.coefficients[k];
    return total;
  }

  /** `G(l) = sum q^r m^(1-r) = sum q (q/m)^(r-1)`. */
  private reverse(weight: number): number {
    let sum = 0;
    for (let i = 0; i < this.publicRow.length; i++) {
      const ratio = this.publicRow[i] / (this.direction[i] * weight + this.publicRow[i]);
      sum += (this.reverseOrder === 3 ? ratio * ratio : ratio ** (this.reverseOrder - 1)) * this.publicRow[i];
    }
    return sum;
  }
}

/** DP-Fusion's per-step mixing weight `lambda` (see {@link Mixing}). */
export function dpFusionLambda(pPrivate: Float32Array, pPublic: Float32Array, bound: number, order = 2.0): number {
  return new Mixing(pPrivate, pPublic, bound, order).weight();
}

/**
 * DP-Fusion: `epsilon` is the Renyi-DP budget at order `a` of one token between any two private contexts
 * (`b = (2a - 2) / (4a - 3) * eps`).  Edge-side the synced token is one draw from
 * `alpha * q~ + (1 - alpha) * mixture`; cloud-side the mixture's top `upload_k` probabilities are uploaded (no DP
 * guarantee follows there: `epsilon` only calibrates `b`).
 */
export class DPFusion extends Policy {
  readonly name = "dp_fusion";
  readonly modes: ReadonlySet<FusionMode> = new Set<FusionMode>(["cloud", "edge"]);
  readonly epsilon: number;
  readonly order: number;
  readonly delta: number;
  readonly maxNewTokens: number;
  readonly uploadK: number;
  /** The per-context bound `b` (0: nothing private is used). */
  readonly bound: number;

  constructor(params: { epsilon?: number; order?: number; delta?: number; max_new_tokens?: number;
    upload_k?: number } = {}) {
    super();
    this.epsilon = params.epsilon ?? 2.0;
    this.order = params.order ?? 2.0;
    this.delta = params.delta ?? 1e-5;
    this.maxNewTokens = params.max_new_tokens ?? 256;
    this.uploadK = params.upload_k ?? 100;
    checkPositiveInt(this.uploadK, "DP-Fusion upload size upload_k");
    checkPositiveInt(this.maxNewTokens, "max_new_tokens");
    checkDelta(this.delta);
    if (!(checkOrder(this.order) <= MAX_ORDER)) {
      throw new InvalidArgumentError(`DP-Fusion's Renyi order must lie in (1, ${MAX_ORDER}], got ${this.order}`);
    }
    this.bound = dpFusionBound(checkEpsilon(this.epsilon), this.order);
  }

  protected parameters(): [string, Described][] {
    return [["epsilon", { float: this.epsilon }], ["order", { float: this.order }], ["delta", { float: this.delta }],
      ["max_new_tokens", { int: this.maxNewTokens }], ["upload_k", { int: this.uploadK }]];
  }

  override maxUpload(vocabSize: number): number {
    return Math.min(this.uploadK, vocabSize);
  }

  /** The `(eps, delta)` of `max_new_tokens` edge-side tokens: `(a, T * eps)`-RDP, improved conversion. */
  generationEpsilon(): number {
    return rdpEpsilon(this.maxNewTokens * this.epsilon, this.order, this.delta);
  }

  override forGeneration(maxNewTokens: number): DPFusion {
    if (maxNewTokens === this.maxNewTokens) return this;
    return new DPFusion({ epsilon: this.epsilon, order: this.order, delta: this.delta, max_new_tokens: maxNewTokens,
      upload_k: this.uploadK });
  }

  override releaseEvent(mode: FusionMode): ReleaseEvent {
    if (mode === "cloud" && this.bound === 0) {
      return new ReleaseEvent("pure_dp", 0, { note: "epsilon 0: every upload is the public distribution's" });
    }
    if (mode === "cloud") {
      return ReleaseEvent.nonPrivate(
        "cloud-side DP-Fusion uploads probabilities: epsilon calibrates the bound, the release is not DP");
    }
    return new ReleaseEvent("renyi", dpFusionPairRdp(this.bound, this.order), {
      delta: this.delta, order: this.order, note: "each token: one draw from the bounded mixture",
      sourceValue: this.bound,
    });
  }

  override cloudUpload(pSlm: Float32Array, pLlm: Float32Array): CloudUpload {
    const weight = dpFusionLambda(pSlm, pLlm, this.bound, this.order);
    const keep = f32(1 - weight);
    const take = f32(weight);
    const mixture = pLlm.map((p, i) => f32(p * keep) + f32(pSlm[i] * take));
    return CloudUpload.of(mixture, topKIds(mixture, this.uploadK));
  }

  /** One draw from `(1 - w) q~ + w p~`, `w = (1 - alpha) lambda`: a uniform `u` picks `p~` iff `u / (1 - alpha)` is a
   * feasible weight, decided without solving for `lambda`. */
  override edgeToken(pSlm: Float32Array, pLlm: Float32Array, alpha: number, draws?: Draws): SyncedToken {
    const source = requireDraws(draws, this.name);
    if (!(alpha >= 0 && alpha <= 1)) throw new InvalidArgumentError(`fusion weight alpha must lie in [0, 1], got ${alpha}`);
    const share = 1 - alpha;
    const mixing = new Mixing(pSlm, pLlm, this.bound, this.order);
    const threshold = source.random();
    const fromPrivate = share > 0 && threshold > 0 && mixing.allows(threshold / share);
    return new SyncedToken(mixing.draw(fromPrivate, source));
  }
}
