/**
 * CoVeil: per-step privacy-utility optimisation of what the cloud observes (Python: `edge_sdk.policies.coveil`).
 * Both rules minimise `J = -U + lambda * P` with one decision per step; probability space is the paper's, logit
 * space the authors' release (raw logits, float32 arithmetic as the release).
 */

import { InvalidArgumentError } from "../core/errors.js";
import {
  argmax,
  argmin,
  checkAlpha,
  checkSpace,
  fuse,
  fuseUpload,
  type FusionSpace,
  inTopK,
  scratch,
  sortedByValue,
  sumFloat32,
  topKIds,
} from "../core/fusion.js";
import { CloudUpload, type Described, type FusionMode, Policy, SyncedToken } from "./base.js";

const f32 = Math.fround;

function check(lam: number, k: number): void {
  if (!(lam >= 0)) throw new InvalidArgumentError(`privacy weight lam must be >= 0, got ${lam}`);
  if (!(k >= 1)) throw new InvalidArgumentError(`candidate pool size k must be >= 1, got ${k}`);
}

export interface CoVeilSettings {
  alpha: number;
  lam: number;
  k: number;
}

/**
 * Cloud-side CoVeil (probability space): the ids of `p_slm` to upload, ascending.
 *
 * `C = TopK(p_slm, k)`, `y* = argmax(alpha * p_llm + (1 - alpha) * p_slm)`; the upload is `{y*}` when `y*` is in
 * `C` and `g(y*) = -(1 - alpha) * p_slm(y*) * (1 - 1/|C|) + lam * |p_slm(y*) - p_llm(y*)| < 0`, else empty
 * (every other candidate has `g >= 0`).
 */
export function coveilUpload(pSlm: Float32Array, pLlm: Float32Array, { alpha, lam, k }: CoVeilSettings): number[] {
  checkAlpha(alpha);
  check(lam, k);
  const yStar = argmax(fuse(pLlm, pSlm, alpha, scratch(pSlm.length, "coveil")));
  if (!inTopK(pSlm, yStar, k)) return [];
  const pool = Math.min(k, pSlm.length);
  const s = pSlm[yStar];
  const g = -(1.0 - alpha) * s * (1.0 - 1.0 / pool) + lam * Math.abs(s - pLlm[yStar]);
  return g < 0 ? [yStar] : [];
}

/**
 * Edge-side CoVeil (probability space): `C = TopK(p_fuse, k)`, `y* = argmax p_fuse` and
 * `J(i) = -(p_fuse(i) - p_fuse(y*)) + lam * (p_slm(i) - p_llm(i))`; returns `argmin_{i in C} J(i)`, ties to the
 * higher `p_fuse`, then the lower id.
 */
export function coveilSelect(pSlm: Float32Array, pLlm: Float32Array, { alpha, lam, k }: CoVeilSettings): number {
  checkAlpha(alpha);
  check(lam, k);
  const pFuse = fuse(pLlm, pSlm, alpha, scratch(pSlm.length, "coveil"));
  const candidates = topKIds(pFuse, k);
  if (lam === 0) return candidates[0];
  const top = pFuse[candidates[0]];
  const objective = candidates.map((c) => -(pFuse[c] - top) + lam * (pSlm[c] - pLlm[c]));
  return candidates[argmin(objective)];
}

/** The release's upload rule `S = {c in C : -(1-a) z_S(c) (1[c=w] - 1/K) + lam |z_S(c) - z_L(c)| < 0}` (float32). */
function releaseUploadRule(
  zSlm: Float32Array, zLlm: Float32Array, candidates: number[], winner: number, alpha: number, lam: number,
): number[] {
  const share = f32(1.0 - alpha);
  const inverse = f32(1.0 / candidates.length);
  const weight = f32(lam);
  const chosen = candidates.filter((c) => {
    const indicator = f32((c === winner ? 1 : 0) - inverse);
    const utility = f32(f32(share * zSlm[c]) * indicator);
    const privacy = f32(weight * Math.abs(f32(zSlm[c] - zLlm[c])));
    return f32(-utility + privacy) < 0;
  });
  return chosen.sort((x, y) => x - y);
}

/**
 * Cloud-side CoVeil on raw logits, as the authors' release: `C = TopK(z_S, K)`,
 * `r = alpha * z_L` with `(1 - alpha) * z_S` added on `C`, `w = argmax r`, then the upload rule above.
 */
export function coveilUploadLogit(zSlm: Float32Array, zLlm: Float32Array, { alpha, lam, k }: CoVeilSettings): number[] {
  checkAlpha(alpha);
  check(lam, k);
  const candidates = topKIds(zSlm, k);
  const row = scratch(zSlm.length, "coveil");
  const winner = argmax(fuseUpload(zLlm, candidates, candidates.map((c) => zSlm[c]), alpha, row));
  return releaseUploadRule(zSlm, zLlm, candidates, winner, alpha, lam);
}

/** `TopK(z_L, k)` plus `extra`, unique, by decreasing `z_L` (ties to the lower id). */
function releaseCandidates(zLlm: Float32Array, k: number, extra: number[]): number[] {
  return sortedByValue(zLlm, [...new Set([...topKIds(zLlm, k), ...extra])]);
}

/** `argmin_{c in C} u(c) + lam * p(c)` (first in `C`'s order on ties), float32 as the release. */
function releaseSelectRule(
  zSlm: Float32Array, zLlm: Float32Array, candidates: number[], winner: number, alpha: number, lam: number,
): number {
  const small = Float32Array.from(candidates, (c) => zSlm[c]);
  const large = Float32Array.from(candidates, (c) => zLlm[c]);
  const inverse = f32(1.0 / candidates.length);
  const share = f32(1.0 - alpha);
  const weight = f32(lam);
  const smallMean = f32(sumFloat32(small) / small.length);
  const largeMean = f32(sumFloat32(large) / large.length);
  const total = candidates.map((c, j) => {
    const indicator = f32((c === winner ? 1 : 0) - inverse);
    const utilityCost = -f32(f32(share * small[j]) * indicator);
    const privacyCost = f32(f32(small[j] - smallMean) - f32(large[j] - largeMean));
    return f32(utilityCost + f32(weight * privacyCost));
  });
  return candidates[argmin(total)];
}

/**
 * Edge-side CoVeil on raw logits, as the authors' release:
 *
 *     f = alpha * z_L + (1 - alpha) * z_S
 *     C = TopK(z_L, K) ∪ {argmax f, argmax z_L}                 (ordered by decreasing z_L)
 *     r = alpha * z_L,  r[C] += (1 - alpha) * z_S[C],  w = argmax r   (w outside C: add it, recompute once)
 *     u(c) = -(1 - alpha) * z_S(c) * (1[c = w] - 1/|C|)
 *     p(c) = (z_S(c) - mean_C z_S) - (z_L(c) - mean_C z_L)
 *     choose argmin_{c in C} u(c) + lam * p(c)
 */
export function coveilSelectLogit(zSlm: Float32Array, zLlm: Float32Array, { alpha, lam, k }: CoVeilSettings): number {
  checkAlpha(alpha);
  check(lam, k);
  const row = scratch(zSlm.length, "coveil");
  const fusedTop = argmax(fuse(zLlm, zSlm, alpha, row));
  let candidates = releaseCandidates(zLlm, k, [fusedTop, argmax(zLlm)]);
  const winnerOf = (pool: number[]): number =>
    argmax(fuseUpload(zLlm, pool, pool.map((c) => zSlm[c]), alpha, row));
  let winner = winnerOf(candidates);
  if (!candidates.includes(winner)) {
    candidates = releaseCandidates(zLlm, k, [...candidates, winner]);
    winner = winnerOf(candidates);
  }
  return releaseSelectRule(zSlm, zLlm, candidates, winner, alpha, lam);
}

/** CoVeil in both fusion modes and both spaces (the SDK's default policy). */
export class CoVeil extends Policy {
  readonly name = "coveil";
  readonly modes: ReadonlySet<FusionMode> = new Set<FusionMode>(["cloud", "edge"]);
  override readonly space: FusionSpace;
  readonly lam: number;
  readonly k: number;

  constructor(params: { lam?: number; k?: number; space?: FusionSpace } = {}) {
    super();
    this.lam = params.lam ?? 1.0;
    this.k = params.k ?? 50;
    check(this.lam, this.k);
    this.space = checkSpace(params.space ?? "prob");
  }

  protected parameters(): [string, Described][] {
    return [["lam", { float: this.lam }], ["k", { int: this.k }]];
  }

  override llmSupport(mode: FusionMode): number | null {
    if (this.space === "logit") return null;
    return mode === "cloud" ? 1 : this.k;
  }

  override maxUpload(vocabSize: number): number {
    return Math.min(this.space === "prob" ? 1 : this.k, vocabSize);
  }

  override needsFullRow(): boolean {
    return false; // both rules in both spaces decide from the top values at the public fill
  }

  override cloudUpload(pSlm: Float32Array, pLlm: Float32Array, alpha: number): CloudUpload {
    const settings = { alpha, lam: this.lam, k: this.k };
    const ids = this.space === "logit" ? coveilUploadLogit(pSlm, pLlm, settings) : coveilUpload(pSlm, pLlm, settings);
    return CloudUpload.of(pSlm, ids, this.space);
  }

  override edgeToken(pSlm: Float32Array, pLlm: Float32Array, alpha: number): SyncedToken {
    const settings = { alpha, lam: this.lam, k: this.k };
    return new SyncedToken(
      this.space === "logit" ? coveilSelectLogit(pSlm, pLlm, settings) : coveilSelect(pSlm, pLlm, settings),
    );
  }
}
