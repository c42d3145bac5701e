/**
 * DP-Logit, cloud-side: the Gaussian mechanism on the uploaded SLM probabilities (Python:
 * `edge_sdk.policies.dp_logit`, a reconstruction: the textbook Gaussian mechanism on the full next-token vector).
 */

import { type Draws, topKIds } from "../core/fusion.js";
import { InvalidArgumentError } from "../core/errors.js";
import { ReleaseEvent } from "../privacy/accountant.js";
import { analyticGaussianSigma, checkDelta, checkEpsilon, checkPositiveInt } from "../privacy/accounting.js";
import { CloudUpload, type Described, type FusionMode, Policy, requireDraws } from "./base.js";

const f32 = Math.fround;

/** L2 distance between two probability vectors is at most sqrt(2). */
export const PROBABILITY_L2_SENSITIVITY = Math.SQRT2;
/** Bits of each 64-bit word that set the Box-Muller radius (the other 24 set the angle). */
const RADIUS_BITS = 40;
const ANGLE_BITS = 64 - RADIUS_BITS;

/**
 * `n` standard normal draws as float32 by the Box-Muller transform, one pair per 64-bit word of `draws`: its top
 * 40 bits a uniform `u = (k + 1/2) / 2^40`, its low 24 bits an angle `2 pi j / 2^24`, and
 * `(r cos theta, r sin theta)` with `r = sqrt(-2 log u)` (the first half of the output the cosines, the second
 * the sines, as Python lays them out).  `log`, `cos` and `sin` are this runtime's float64 ones rounded to float32
 * (numpy's float32 ones are SIMD approximations), so a draw can differ from Python's in its last bits.
 */
export function standardNormalFloat32(n: number, draws: Draws): Float32Array {
  const pairs = Math.floor((n + 1) / 2);
  const raw = draws.randomRaw(pairs);
  // each word as its two little-endian 32-bit halves: no BigInt arithmetic per draw
  const halves = new Uint32Array(raw.buffer, raw.byteOffset, 2 * pairs);
  const out = new Float32Array(2 * pairs);
  const angleScale = f32((2 * Math.PI) / 2 ** ANGLE_BITS);
  const half = f32(2 ** -(RADIUS_BITS + 1));
  const angleMask = 2 ** ANGLE_BITS - 1;
  const lowShift = 2 ** (32 - ANGLE_BITS);
  for (let j = 0; j < pairs; j++) {
    const low = halves[2 * j];
    const high = halves[2 * j + 1];
    const angle = f32((low & angleMask) * angleScale);
    const radiusBits = high * lowShift + (low >>> ANGLE_BITS); // the word's top 40 bits, exact in a double
    let radius = f32(f32(radiusBits * 2 ** -RADIUS_BITS) + half);
    radius = f32(Math.sqrt(f32(f32(Math.log(radius)) * -2)));
    out[j] = f32(radius * f32(Math.cos(angle)));
    out[pairs + j] = f32(f32(Math.sin(angle)) * radius);
  }
  return out.subarray(0, n);
}

/**
 * The Gaussian mechanism on the full SLM vector, then post-processing on the edge:
 * `x~ = p_slm + N(0, sigma^2 I_V)`, `ids = TopK(x~, k)`, `values = clip(x~[ids], 0, 1)` (float32).
 */
export function dpLogitUpload(pSlm: Float32Array, sigma: number, uploadK: number, draws: Draws):
  { ids: number[]; values: number[] } {
  if (!(sigma > 0)) throw new InvalidArgumentError(`Gaussian noise scale sigma must be > 0, got ${sigma}`);
  checkPositiveInt(uploadK, "DP-Logit upload size upload_k");
  const noisy = standardNormalFloat32(pSlm.length, draws);
  const scale = f32(sigma);
  for (let i = 0; i < noisy.length; i++) noisy[i] = f32(noisy[i] * scale) + pSlm[i];
  const ids = topKIds(noisy, uploadK);
  return { ids, values: ids.map((id) => Math.min(Math.max(noisy[id], 0), 1)) };
}

/** DP-Logit, cloud-side: `epsilon` is one token's `(epsilon, delta)`-DP budget. */
export class DPLogit extends Policy {
  readonly name = "dp_logit";
  readonly modes: ReadonlySet<FusionMode> = new Set<FusionMode>(["cloud"]);
  readonly epsilon: number;
  readonly delta: number;
  readonly uploadK: number;
  /** The Gaussian noise scale calibrated from `(epsilon, delta)`. */
  readonly sigma: number;

  constructor(params: { epsilon?: number; delta?: number; upload_k?: number } = {}) {
    super();
    this.epsilon = params.epsilon ?? 1.0;
    this.delta = params.delta ?? 1e-5;
    this.uploadK = checkPositiveInt(params.upload_k ?? 100, "DP-Logit upload size upload_k");
    this.sigma = analyticGaussianSigma(checkEpsilon(this.epsilon), checkDelta(this.delta), PROBABILITY_L2_SENSITIVITY);
  }

  protected parameters(): [string, Described][] {
    return [["epsilon", { float: this.epsilon }], ["delta", { float: this.delta }], ["upload_k", { int: this.uploadK }]];
  }

  /** Each upload is the Gaussian mechanism at noise multiplier `sigma / sqrt 2`, any two contexts. */
  override releaseEvent(): ReleaseEvent {
    return new ReleaseEvent("gaussian", this.sigma / PROBABILITY_L2_SENSITIVITY, {
      delta: this.delta, note: "each upload: the Gaussian mechanism on the whole SLM vector",
    });
  }

  override maxUpload(vocabSize: number): number {
    return Math.min(this.uploadK, vocabSize);
  }

  override llmSupport(): number {
    return 0;
  }

  override cloudUpload(pSlm: Float32Array, _pLlm: Float32Array, _alpha: number, draws?: Draws): CloudUpload {
    const { ids, values } = dpLogitUpload(pSlm, this.sigma, this.uploadK, requireDraws(draws, this.name));
    return new CloudUpload(ids, values);
  }
}
