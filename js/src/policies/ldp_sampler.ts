/**
 * LDP-Sampler, edge-side: the locally optimal pure epsilon-LDP sampler with `p_llm` as the public anchor (after
 * Ghoukasian, Lee & Asoodeh, NeurIPS 2025; Python: `edge_sdk.policies.ldp_sampler`).
 */

import { BlockSampler, type Draws, sumFloat64 } from "../core/fusion.js";
import { InvalidArgumentError } from "../core/errors.js";
import { ReleaseEvent } from "../privacy/accountant.js";
import { checkEpsilon } from "../privacy/accounting.js";
import { type Described, type FusionMode, Policy, requireDraws, SyncedToken } from "./base.js";

/** `[m, e^eps * m]` with `m = (gamma + 1) / (e^eps + gamma)`, computed without overflow. */
export function ldpSamplerRatioBounds(epsilon: number, gamma: number): [number, number] {
  checkEpsilon(epsilon);
  if (!(gamma >= 1 && Number.isFinite(gamma))) {
    throw new InvalidArgumentError(`neighbourhood ratio gamma must be finite and >= 1, got ${gamma}`);
  }
  const decay = Math.exp(-epsilon);
  return [((gamma + 1) * decay) / (1 + gamma * decay), (gamma + 1) / (1 + gamma * decay)];
}

function checkRow(row: Float32Array, what: string): void {
  if (row.length === 0) throw new InvalidArgumentError(`${what} must be a non-empty 1-D array`);
  let top = -Infinity;
  let low = Infinity;
  let finite = true;
  for (let i = 0; i < row.length; i++) {
    const value = row[i];
    if (value !== value) finite = false; // NaN
    if (value > top) top = value;
    if (value < low) low = value;
  }
  if (!finite) top = NaN;
  if (!(Number.isFinite(top) && top > 0 && low >= 0)) {
    throw new InvalidArgumentError(`${what} must be non-negative and finite with positive mass`);
  }
}

/** `[w(P > 0), w(P = 0)]`, each summed directly. */
function supportMasses(ratio: Float64Array, weights: Float64Array): [number, number] {
  let inside = 0;
  let outside = 0;
  for (let i = 0; i < ratio.length; i++) {
    const positive = ratio[i] > 0 ? 1 : 0;
    inside += weights[i] * positive;
    outside += weights[i] * (1 - positive);
  }
  return [inside, outside];
}

/**
 * One id drawn from the sampler's `Q(x) = P0(x)/s0 * clip(k(x) t*, m, M)` (`k = P / P0`, `t*` the normaliser),
 * without solving for `t*`: propose `x ~ P0`, accept iff `u * M < clip(k(x) t*, m, M)` (always when `u M < m`;
 * otherwise iff `S(tau) < 1` at `tau = u M / k(x)`, `S` the normaliser's non-decreasing mass), each evaluation of
 * `S` also narrowing the bracket of `t*` that decides later proposals; ids off `P`'s support are accepted with
 * `m / M`, or `c / M` when no normaliser exists.
 */
export function ldpSamplerDraw(pPrivate: Float32Array, pPublic: Float32Array, epsilon: number, gamma: number,
  draws: Draws): number {
  checkRow(pPrivate, "private distribution P");
  checkRow(pPublic, "public anchor P0");
  if (pPrivate.length !== pPublic.length) {
    throw new InvalidArgumentError(`P and P0 differ in length: ${pPrivate.length} vs ${pPublic.length}`);
  }
  const [low, high] = ldpSamplerRatioBounds(epsilon, gamma);
  const weights = Float64Array.from(pPublic);
  const proposals = new BlockSampler(weights);
  if (low === high) return proposals.draw(draws);
  const total = sumFloat64(weights);
  const ratio = new Float64Array(pPrivate.length);
  for (let i = 0; i < ratio.length; i++) ratio[i] = pPrivate[i] / weights[i];
  let cleaned = false;
  const clean = (): void => {
    for (let i = 0; i < ratio.length; i++) if (ratio[i] !== ratio[i]) ratio[i] = 0;
  };
  const mass = (t: number): number => {
    const floor = low / t;
    const ceiling = high / t;
    let sum = 0; // sum weights * clip(ratio, floor, ceiling), in order (NaN stays NaN, as np.clip keeps it)
    for (let i = 0; i < ratio.length; i++) {
      const r = ratio[i];
      sum += weights[i] * (r < floor ? floor : r > ceiling ? ceiling : r);
    }
    const value = (t * sum) / total;
    if (Number.isNaN(value) && !cleaned) { // 0/0 where both are 0: those ids have no weight
      clean();
      cleaned = true;
      return mass(t);
    }
    return value;
  };
  let tLow = 0;
  let tHigh = Infinity;
  let offSupportCeiling: number | null = null;
  for (;;) {
    const x = proposals.draw(draws);
    const threshold = draws.random() * high;
    if (threshold < low) return x;
    const ratioX = pPrivate[x] / pPublic[x];
    if (ratioX === 0) {
      if (offSupportCeiling === null) {
        offSupportCeiling = low;
        const cleanRatio = ratio.map((r) => (r !== r ? 0 : r));
        const [inside, outside] = supportMasses(cleanRatio, weights);
        if (!(((high - 1) / (1 - low)) * inside > outside)) offSupportCeiling = 1 - ((high - 1) * inside) / outside;
      }
      if (threshold < offSupportCeiling) return x;
      continue;
    }
    const tau = threshold / ratioX;
    if (tau < tLow) return x;
    if (tau >= tHigh) continue;
    const value = mass(tau);
    if (value < 1) {
      tLow = Math.max(tLow, tau / value);
      return x;
    }
    tHigh = Math.min(tHigh, tau / value);
  }
}

/** LDP-Sampler, edge-side: `epsilon` is one token's pure `eps`-LDP budget; `gamma` the neighbourhood ratio. */
export class LDPSampler extends Policy {
  readonly name = "ldp_sampler";
  readonly modes: ReadonlySet<FusionMode> = new Set<FusionMode>(["edge"]);
  readonly epsilon: number;
  readonly gamma: number;

  constructor(params: { epsilon?: number; gamma?: number } = {}) {
    super();
    this.epsilon = params.epsilon ?? 2.0;
    this.gamma = params.gamma ?? 2.0;
    ldpSamplerRatioBounds(this.epsilon, this.gamma);
  }

  protected parameters(): [string, Described][] {
    return [["epsilon", { float: this.epsilon }], ["gamma", { float: this.gamma }]];
  }

  /** Each token: pure `epsilon`-LDP (stated at delta 0 unless the ledger is asked for another). */
  override releaseEvent(): ReleaseEvent {
    return new ReleaseEvent("pure_dp", checkEpsilon(this.epsilon), { note: "each token: one draw of the eps-LDP sampler" });
  }

  override edgeToken(pSlm: Float32Array, pLlm: Float32Array, _alpha: number, draws?: Draws): SyncedToken {
    return new SyncedToken(ldpSamplerDraw(pSlm, pLlm, this.epsilon, this.gamma, requireDraws(draws, this.name)));
  }
}
