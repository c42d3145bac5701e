/**
 * Log-probabilities of the chosen tokens (Python: `edge_sdk.logprobs`), read off the *fused* row the token was
 * chosen from, after every mask that applied there, renormalised over what is left, before any temperature:
 *
 *     probability space:  log q_i = log(f_i / sum_j f_j),      f = alpha * p_llm + (1 - alpha) * p_slm (masked)
 *     logit space:        log q_i = z_i - logsumexp(z),          z = alpha * z_llm + (1 - alpha) * z_slm (masked)
 *
 * Edge-side the decoder reads them off `StepDecision.fused()` (the cloud's own row on a withheld step).  A masked
 * id has log-probability `-inf` and is never listed among the top ones.
 */

import { InvalidArgumentError } from "./errors.js";
import { FLOAT32_LOWEST, type FusionSpace, sumFloat64, topKIds } from "./fusion.js";

/** The most alternatives a token's log-probabilities list (OpenAI's `top_logprobs` <= 20). */
export const MAX_TOP_LOGPROBS = 20;

/** A token's log-probability under the row it was picked from, and the row's best ids with theirs (by decreasing
 * log-probability, ties to the lower id). */
export interface TokenLogprobs {
  tokenId: number;
  logprob: number;
  top: ReadonlyArray<readonly [number, number]>;
}

/**
 * `row` (a masked fused row) as float64 log-probabilities.  Probability space: entries at or below 0 are `-inf`,
 * and a row with no mass is an error.  Logit space: float32's lowest value (what a mask sets) is `-inf`.  Sums in
 * numpy's pairwise order; `Math.log`/`Math.exp` stand in for the C library's (see the conformance test).
 */
export function logDistribution(row: Float32Array, space: FusionSpace): Float64Array {
  const out = new Float64Array(row.length);
  if (space === "logit") {
    let top = -Infinity;
    for (let i = 0; i < row.length; i++) {
      out[i] = row[i] <= FLOAT32_LOWEST ? -Infinity : row[i];
      if (out[i] > top) top = out[i];
    }
    const shifted = new Float64Array(row.length);
    for (let i = 0; i < row.length; i++) shifted[i] = Math.exp(out[i] - top);
    const normaliser = top + Math.log(sumFloat64(shifted));
    for (let i = 0; i < row.length; i++) out[i] -= normaliser;
    return out;
  }
  const positive: number[] = [];
  for (let i = 0; i < row.length; i++) if (row[i] > 0) positive.push(row[i]);
  const total = sumFloat64(positive);
  if (!(total > 0)) throw new InvalidArgumentError("the fused row holds no probability: no token could have been chosen from it");
  const logTotal = Math.log(total);
  for (let i = 0; i < row.length; i++) out[i] = row[i] > 0 ? Math.log(row[i]) - logTotal : -Infinity;
  return out;
}

/** The log-probability of `tokenId` under `row` and the row's `topN` best ids (0 <= topN <= 20). */
export function tokenLogprobs(row: Float32Array, space: FusionSpace, tokenId: number, topN: number): TokenLogprobs {
  if (!(Number.isInteger(topN) && topN >= 0 && topN <= MAX_TOP_LOGPROBS)) {
    throw new InvalidArgumentError(`top_logprobs must lie in [0, ${MAX_TOP_LOGPROBS}], got ${topN}`);
  }
  const logq = logDistribution(row, space);
  const top = topKIds(logq, topN).filter((i) => Number.isFinite(logq[i])).map((i) => [i, logq[i]] as const);
  return { tokenId, logprob: logq[tokenId], top };
}
