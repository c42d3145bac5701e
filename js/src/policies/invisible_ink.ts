/**
 * InvisibleInk (Vinod, Pillutla & Thakurta, NeurIPS 2025), edge-side: clipped logit differences, one sampled
 * token (Python: `edge_sdk.policies.invisible_ink`).
 */

import { type Draws, FLOAT32_TINY, sampleIndex, sumFloat64, topKIds } from "../core/fusion.js";
import { InvalidArgumentError } from "../core/errors.js";
import { ReleaseEvent } from "../privacy/accountant.js";
import { checkEpsilon, checkPositiveInt, invisibleInkClip } from "../privacy/accounting.js";
import { type Described, type FusionMode, Policy, requireDraws, SyncedToken } from "./base.js";

const f32 = Math.fround;

/** InvisibleInk's sampling temperature in its original code. */
export const DEFAULT_TEMPERATURE = 1.1;

/** `null` or 0 mean the whole vocabulary; otherwise a positive integer. */
function checkTopK(topK: number | null): number | null {
  if (topK === null || topK === 0) return null;
  return checkPositiveInt(topK, "InvisibleInk top_k");
}

/** `log` of a row renormalised to sum 1 (float32, zeros at float32's smallest normal). */
function logRenormalised(row: Float32Array): Float32Array {
  const total = sumFloat64(row);
  if (!(total > 0 && Number.isFinite(total))) {
    throw new InvalidArgumentError(`InvisibleInk needs distributions with a positive finite mass, got a sum of ${total}`);
  }
  const scale = f32(1 / total);
  return row.map((p) => Math.log(Math.max(f32(p * scale), FLOAT32_TINY)));
}

/**
 * InvisibleInk's sampling weights for one private reference, unnormalised, with the ids they cover (`null`: all):
 *
 *     z_pub = log p_llm,   z_priv = log p_slm        (each row renormalised to sum 1 first)
 *     z_bar = z_pub + clip(z_priv - z_pub, -C, C)
 *     V_k+  = {y : z_pub(y) >= z_pub^(k) - 2C}        (every y when top_k is null)
 *     w(y)  = exp((z_bar(y) - max z_bar) / tau) on V_k+
 *
 * float32 as Python; `log` and `exp` are this runtime's rounded to float32 (numpy's float32 ones are SIMD
 * approximations, so a weight can differ from Python's in its last bits).
 */
export function invisibleInkWeights(
  pSlm: Float32Array, pLlm: Float32Array, clip: number, topK: number | null, temperature: number,
): { ids: number[] | null; weights: Float32Array } {
  if (!(clip >= 0 && Number.isFinite(clip))) throw new InvalidArgumentError(`clip bound C must be finite and >= 0, got ${clip}`);
  if (!(temperature > 0 && Number.isFinite(temperature))) {
    throw new InvalidArgumentError(`sampling temperature must be finite and > 0, got ${temperature}`);
  }
  const k = checkTopK(topK);
  let publicRow = logRenormalised(pLlm);
  let privateRow = logRenormalised(pSlm);
  let ids: number[] | null = null;
  if (k !== null) {
    const top = topKIds(publicRow, k);
    const cut = f32(publicRow[top[top.length - 1]] - 2 * clip);
    ids = [];
    for (let i = 0; i < publicRow.length; i++) if (publicRow[i] >= cut) ids.push(i);
    const chosen = ids;
    publicRow = Float32Array.from(chosen, (i) => publicRow[i]);
    privateRow = Float32Array.from(chosen, (i) => privateRow[i]);
  }
  const low = f32(-clip);
  const high = f32(clip);
  let top = -Infinity;
  for (let i = 0; i < privateRow.length; i++) {
    const difference = Math.min(Math.max(f32(privateRow[i] - publicRow[i]), low), high);
    privateRow[i] = difference + publicRow[i];
    if (privateRow[i] > top) top = privateRow[i];
  }
  const inverse = f32(1 / temperature);
  for (let i = 0; i < privateRow.length; i++) {
    const shifted = f32(privateRow[i] - top);
    privateRow[i] = Math.exp(temperature === 1 ? shifted : f32(shifted * inverse));
  }
  return { ids, weights: privateRow };
}

/** InvisibleInk, edge-side: `epsilon` is the whole generation's `(epsilon, delta)` over `max_new_tokens` tokens. */
export class InvisibleInk extends Policy {
  readonly name = "invisible_ink";
  readonly modes: ReadonlySet<FusionMode> = new Set<FusionMode>(["edge"]);
  readonly epsilon: number;
  readonly delta: number;
  readonly topK: number | null;
  readonly temperature: number;
  readonly maxNewTokens: number;
  /** The logit-difference clip bound `C` calibrated from `epsilon`. */
  readonly clip: number;

  constructor(params: { epsilon?: number; delta?: number; top_k?: number | null; temperature?: number;
    max_new_tokens?: number } = {}) {
    super();
    this.epsilon = params.epsilon ?? 10.0;
    this.delta = params.delta ?? 1e-6;
    this.topK = params.top_k ?? null;
    this.temperature = params.temperature ?? DEFAULT_TEMPERATURE;
    this.maxNewTokens = params.max_new_tokens ?? 256;
    checkTopK(this.topK);
    this.clip = invisibleInkClip(checkEpsilon(this.epsilon), this.maxNewTokens, this.delta, this.temperature);
  }

  protected parameters(): [string, Described][] {
    return [["epsilon", { float: this.epsilon }], ["delta", { float: this.delta }],
      ["top_k", this.topK === null ? null : { int: this.topK }], ["temperature", { float: this.temperature }],
      ["max_new_tokens", { int: this.maxNewTokens }]];
  }

  /** The budget spread over `maxNewTokens` tokens (a larger clip for a shorter generation). */
  override forGeneration(maxNewTokens: number): InvisibleInk {
    if (maxNewTokens === this.maxNewTokens) return this;
    return new InvisibleInk({ epsilon: this.epsilon, delta: this.delta, top_k: this.topK,
      temperature: this.temperature, max_new_tokens: maxNewTokens });
  }

  /** Each token, any two contexts: `rho = 2 (C / tau)^2`-zCDP; the source's relation `(C / tau)^2 / 2`. */
  override releaseEvent(): ReleaseEvent {
    return new ReleaseEvent("zcdp", 2 * (this.clip / this.temperature) ** 2, {
      delta: this.delta, horizon: this.maxNewTokens, note: "each token: one draw from the clipped-logit softmax",
      sourceValue: 0.5 * (this.clip / this.temperature) ** 2,
    });
  }

  override edgeToken(pSlm: Float32Array, pLlm: Float32Array, _alpha: number, draws?: Draws): SyncedToken {
    const { ids, weights } = invisibleInkWeights(pSlm, pLlm, this.clip, this.topK, this.temperature);
    const drawn = sampleIndex(weights, requireDraws(draws, this.name));
    return new SyncedToken(ids === null ? drawn : ids[drawn]);
  }
}
