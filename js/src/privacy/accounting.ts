/**
 * Calibrations and conversions of the DP policies, as Python's `edge_sdk.privacy.analysis`: pure functions
 * that validate their arguments and raise `InvalidArgumentError` naming the offending value.
 *
 * The transcendental functions come from this runtime (`Math.exp`, `Math.log`) and `erfc` from
 * {@link erfc} below, not from the C library Python calls, so a figure found by bisection (a noise scale, an
 * epsilon) can differ from Python's in its last bits; the conformance tests bound that difference.
 */

import { InvalidArgumentError } from "../core/errors.js";

/** Bisection steps for the monotone one-dimensional searches (each halves a bracket). */
const BISECTION_STEPS = 200;

export function checkDelta(delta: number): number {
  if (!(delta > 0 && delta < 1)) throw new InvalidArgumentError(`delta must lie in (0, 1), got ${delta}`);
  return delta;
}

export function checkEpsilon(epsilon: number): number {
  if (!(epsilon >= 0 && Number.isFinite(epsilon))) {
    throw new InvalidArgumentError(`epsilon must be finite and >= 0, got ${epsilon}`);
  }
  return epsilon;
}

export function checkOrder(order: number): number {
  if (!(order > 1 && Number.isFinite(order))) {
    throw new InvalidArgumentError(`Renyi order must be finite and > 1, got ${order}`);
  }
  return order;
}

/** `value` if it is a positive integer, else `InvalidArgumentError` naming `what`. */
export function checkPositiveInt(value: number, what: string): number {
  if (!Number.isInteger(value) || value < 1) {
    throw new InvalidArgumentError(`${what} must be a positive integer, got ${value}`);
  }
  return value;
}

/**
 * The complementary error function `erfc(x) = 2/sqrt(pi) * int_x^inf exp(-t^2) dt`, to about 1e-15 relative.
 *
 * For `|x| < 1`: `erf(x) = 2/sqrt(pi) * exp(-x^2) * sum_n 2^n x^(2n+1) / (1*3*...*(2n+1))` (all terms positive,
 * no cancellation) and `erfc = 1 - erf` (at least 0.157: no cancellation either).  For `x >= 1`: the continued fraction
 * `erfc(x) = exp(-x^2)/sqrt(pi) * 1/(x + (1/2)/(x + 1/(x + (3/2)/(x + ...))))`, evaluated by the modified Lentz
 * method (the lower tail keeps its relative precision).  `erfc(-x) = 2 - erfc(x)`.
 */
export function erfc(x: number): number {
  if (Number.isNaN(x)) return NaN;
  if (x < 0) return 2 - erfc(-x);
  if (x < 1) {
    let term = x;
    let sum = x;
    for (let n = 1; n < 200; n++) {
      term *= (2 * x * x) / (2 * n + 1);
      sum += term;
      if (term < 1e-17 * sum) break;
    }
    return 1 - (2 / Math.sqrt(Math.PI)) * Math.exp(-x * x) * sum;
  }
  if (x > 27.3) return 0; // below float64's smallest subnormal
  const tiny = 1e-300;
  let f = x;
  let c = x;
  let d = 0;
  for (let n = 1; n < 5000; n++) {
    const a = n / 2;
    d = x + a * d;
    d = d === 0 ? tiny : 1 / d;
    c = x + a / c;
    if (c === 0) c = tiny;
    const delta = c * d;
    f *= delta;
    if (Math.abs(delta - 1) < 1e-16) break;
  }
  return Math.exp(-x * x) / Math.sqrt(Math.PI) / f;
}

/** `Phi(x) = erfc(-x / sqrt 2) / 2`. */
export function standardNormalCdf(x: number): number {
  return 0.5 * erfc(-x / Math.SQRT2);
}

/**
 * The exact `delta` of the Gaussian mechanism at `epsilon` (Balle & Wang 2018, Thm. 8):
 * `delta(eps, s) = Phi(D/(2s) - eps*s/D) - e^eps * Phi(-D/(2s) - eps*s/D)`.
 */
export function gaussianDelta(epsilon: number, sigma: number, sensitivity: number): number {
  checkEpsilon(epsilon);
  if (!(sigma > 0)) throw new InvalidArgumentError(`noise scale sigma must be > 0, got ${sigma}`);
  if (!(sensitivity > 0)) throw new InvalidArgumentError(`L2 sensitivity must be > 0, got ${sensitivity}`);
  const halfRatio = sensitivity / (2 * sigma);
  const shift = (epsilon * sigma) / sensitivity;
  const upper = standardNormalCdf(halfRatio - shift);
  const lowerTail = standardNormalCdf(-halfRatio - shift);
  const scaledLower = lowerTail > 0 ? Math.exp(epsilon + Math.log(lowerTail)) : 0;
  return Math.max(0, upper - scaledLower);
}

/** The smallest `sigma` with `gaussianDelta(epsilon, sigma, sensitivity) <= delta` (the upper end of a bisection). */
export function analyticGaussianSigma(epsilon: number, delta: number, sensitivity = 1.0): number {
  checkEpsilon(epsilon);
  checkDelta(delta);
  if (!(sensitivity > 0)) throw new InvalidArgumentError(`L2 sensitivity must be > 0, got ${sensitivity}`);
  const satisfied = (sigma: number): boolean => gaussianDelta(epsilon, sigma, sensitivity) <= delta;
  let high = sensitivity;
  while (!satisfied(high)) high *= 2;
  let low = high;
  while (satisfied(low)) low /= 2;
  for (let i = 0; i < BISECTION_STEPS; i++) {
    const middle = 0.5 * (low + high);
    if (middle === low || middle === high) break;
    if (satisfied(middle)) high = middle;
    else low = middle;
  }
  return high;
}

/**
 * The exact `epsilon` at `delta` of `n` Gaussian mechanisms of noise multiplier `z`: one Gaussian mechanism of
 * sensitivity `sqrt n` at noise `z` (Dong, Roth & Su 2019), its smallest `eps` with `delta(eps) <= delta`.
 */
export function gaussianCompositionEpsilon(noiseMultiplier: number, releases: number, delta: number): number {
  if (!(noiseMultiplier > 0 && Number.isFinite(noiseMultiplier))) {
    throw new InvalidArgumentError(`noise multiplier must be finite and > 0, got ${noiseMultiplier}`);
  }
  checkDelta(delta);
  if (!(releases >= 0)) throw new InvalidArgumentError(`number of releases must be >= 0, got ${releases}`);
  const sensitivity = Math.sqrt(releases);
  if (releases === 0 || gaussianDelta(0, noiseMultiplier, sensitivity) <= delta) return 0;
  let low = 0;
  let high = 1;
  while (gaussianDelta(high, noiseMultiplier, sensitivity) > delta) {
    low = high;
    high *= 2;
  }
  for (let i = 0; i < BISECTION_STEPS; i++) {
    const middle = 0.5 * (low + high);
    if (middle === low || middle === high) break;
    if (gaussianDelta(middle, noiseMultiplier, sensitivity) <= delta) high = middle;
    else low = middle;
  }
  return high;
}

/** `(a, e)`-Renyi-DP implies `(eps, delta)`-DP: `eps = max(0, e + log(1 - 1/a) - (log(delta) + log(a)) / (a - 1))`. */
export function rdpEpsilon(rdp: number, order: number, delta: number): number {
  if (!(rdp >= 0 && Number.isFinite(rdp))) {
    throw new InvalidArgumentError(`Renyi-DP epsilon must be finite and >= 0, got ${rdp}`);
  }
  checkOrder(order);
  const logDelta = Math.log(checkDelta(delta));
  return Math.max(0, rdp + Math.log1p(-1 / order) - (logDelta + Math.log(order)) / (order - 1));
}

/** DP-Fusion's cost at order `a` of one token between any two contexts: `(4a - 3) / (2a - 2) * b`. */
export function dpFusionPairRdp(bound: number, order = 2.0): number {
  checkOrder(order);
  if (!(bound >= 0 && Number.isFinite(bound))) {
    throw new InvalidArgumentError(`DP-Fusion divergence bound must be finite and >= 0, got ${bound}`);
  }
  return ((4 * order - 3) / (2 * order - 2)) * bound;
}

/** The per-context bound `b = (2a - 2) / (4a - 3) * eps` (the inverse of {@link dpFusionPairRdp}). */
export function dpFusionBound(epsilon: number, order = 2.0): number {
  checkOrder(order);
  return ((2 * order - 2) / (4 * order - 3)) * checkEpsilon(epsilon);
}

/**
 * The Renyi order at which the CKS conversion of `rho`-zCDP attains its infimum: the root of
 * `rho*(a-1)^2 = log(1/delta) - log a` on `(1, 1/delta)` (`1/delta` when `rho = 0`), the upper end of a bisection.
 */
export function zcdpOptimalOrder(rho: number, delta: number): number {
  if (!(rho >= 0 && Number.isFinite(rho))) throw new InvalidArgumentError(`zCDP rho must be finite and >= 0, got ${rho}`);
  const logInvDelta = -Math.log(checkDelta(delta));
  let low = 1;
  let high = 1 / delta;
  if (rho > 0) {
    high = Math.min(high, 1 + Math.sqrt(logInvDelta / rho));
    for (let i = 0; i < BISECTION_STEPS; i++) {
      const middle = 0.5 * (low + high);
      if (middle === low || middle === high) break;
      if (rho * (middle - 1) * (middle - 1) < logInvDelta - Math.log(middle)) low = middle;
      else high = middle;
    }
  }
  return high;
}

/** `rho`-zCDP implies `(eps, delta)`-DP (Canonne, Kamath & Steinke 2020): the improved conversion at the optimal order. */
export function zcdpEpsilon(rho: number, delta: number): number {
  const order = zcdpOptimalOrder(rho, delta);
  return rdpEpsilon(rho * order, order, delta);
}

/** The largest `rho` with `zcdpEpsilon(rho, delta) <= epsilon` (the lower end of a bisection; 0 at `epsilon = 0`). */
export function zcdpRho(epsilon: number, delta: number): number {
  checkEpsilon(epsilon);
  checkDelta(delta);
  if (epsilon === 0) return 0;
  let low = 0;
  let high = Math.max(1, epsilon);
  while (zcdpEpsilon(high, delta) <= epsilon) {
    low = high;
    high *= 2;
  }
  for (let i = 0; i < BISECTION_STEPS; i++) {
    const middle = 0.5 * (low + high);
    if (middle === low || middle === high) break;
    if (zcdpEpsilon(middle, delta) <= epsilon) low = middle;
    else high = middle;
  }
  return low;
}

/**
 * InvisibleInk's clip bound `C` for a total `(epsilon, delta)` over `T` tokens, any two contexts:
 * `rho = zcdpRho(eps, delta)`, `rho_token = rho / T`, `C = tau * s * sqrt(rho_token / 2)`.
 */
export function invisibleInkClip(
  epsilon: number, maxNewTokens: number, delta = 1e-6, temperature = 1.0, nPrivate = 1,
): number {
  if (!(temperature > 0)) throw new InvalidArgumentError(`sampling temperature must be > 0, got ${temperature}`);
  if (!Number.isInteger(nPrivate) || nPrivate < 1) {
    throw new InvalidArgumentError(`number of private references must be a positive integer, got ${nPrivate}`);
  }
  const rhoToken = zcdpRho(epsilon, delta) / checkPositiveInt(maxNewTokens, "max_new_tokens");
  return temperature * nPrivate * Math.sqrt(0.5 * rhoToken);
}
