/**
 * `n` pure `eps`-DP releases at a `delta > 0` (LDP-Sampler with a ledger delta), composed as Python composes them:
 * dp-accounting 0.6's PLD accountant (`PLDAccountant(REPLACE_ONE, value_discretization_interval=1e-6)`) over binary
 * randomised response with noise `p = 2 / (1 + e^eps)`, one event at a time (Python:
 * `edge_sdk.privacy.accountant._ComposedEpsilons`).  Binary randomised response dominates every pure `eps`-DP
 * mechanism, and its `n`-fold composition `n` of them (Kairouz, Oh & Viswanath 2015, Thm. 3.3).
 *
 * Ported step by step, in the same float64 order: the PLD's two atoms (losses `+-log((1 - p/2) / (p/2))` rounded
 * up to the 1e-6 grid, masses `exp(log(1 - p/2))` and `exp(log(p/2))`), the sparse composition (a dictionary
 * convolution in insertion order, then the tails of mass <= 1e-15 / 2 cut: the left one added to the first atom,
 * the right one to the infinity mass), and `get_epsilon_for_delta`'s scan from the largest loss.  dp-accounting
 * turns the PMF dense (an FFT convolution) once a composition could exceed 1,000 atoms; that is not ported, and a
 * horizon that would reach it is refused when the accountant is built.
 */

import { NotImplementedInTypeScriptError } from "../core/errors.js";
import { pairwiseSum } from "../core/fusion.js";
import { pyG } from "../core/format.js";

/** dp-accounting's grid for the losses (`value_discretization_interval` as Python's accountant sets it). */
export const PLD_DISCRETIZATION = 1e-6;
/** The tail mass each composition may cut (`PrivacyLossDistribution.compose`'s default). */
const TAIL_MASS_TRUNCATION = 1e-15;
/** dp-accounting's `_MAX_PMF_SPARSE_SIZE`: a composition whose sizes multiply past it goes dense. */
const MAX_SPARSE_SIZE = 1000;

/** A sparse PLD: integer losses on the grid (ascending, except randomised response's own insertion order). */
interface SparsePmf {
  losses: number[];
  probs: number[];
  infinityMass: number;
}

/** The PLD of binary randomised response of privacy loss `epsilon` (`from_randomized_response(p, 2)`). */
function randomizedResponsePmf(epsilon: number): SparsePmf {
  const noise = 2.0 / (1.0 + Math.exp(epsilon));
  const upper = [Math.log(1 - (noise * 1) / 2), Math.log(noise / 2)];
  const lower = [upper[1], upper[0]];
  const byLoss = new Map<number, number>(); // the unrounded losses, in outcome order
  for (let outcome = 0; outcome < 2; outcome++) {
    const loss = upper[outcome] - lower[outcome];
    byLoss.set(loss, (byLoss.get(loss) ?? 0) + Math.exp(upper[outcome]));
  }
  const rounded = new Map<number, number>();
  for (const [loss, prob] of byLoss) {
    const key = Math.ceil(loss / PLD_DISCRETIZATION);
    rounded.set(key, (rounded.get(key) ?? 0) + prob);
  }
  return { losses: [...rounded.keys()], probs: [...rounded.values()], infinityMass: 0 };
}

/** The length of the longest prefix of `probs` (in `order`) whose running sum stays at or below `threshold`. */
function prefixToTruncate(probs: readonly number[], threshold: number, reversed: boolean): number {
  let sum = 0;
  for (let i = 0; i < probs.length; i++) {
    sum += probs[reversed ? probs.length - 1 - i : i];
    if (sum > threshold) return i;
  }
  return probs.length;
}

/** `SparsePLDPmf.compose` (pessimistic tail truncation). */
function compose(a: SparsePmf, b: SparsePmf): SparsePmf {
  const convolution = new Map<number, number>();
  for (let i = 0; i < a.losses.length; i++) {
    for (let j = 0; j < b.losses.length; j++) {
      const key = a.losses[i] + b.losses[j];
      convolution.set(key, (convolution.get(key) ?? 0.0) + a.probs[i] * b.probs[j]);
    }
  }
  const infinityMass = a.infinityMass + b.infinityMass - a.infinityMass * b.infinityMass;
  const losses = [...convolution.keys()].sort((x, y) => x - y);
  const probs = losses.map((loss) => convolution.get(loss) as number);
  const left = prefixToTruncate(probs, TAIL_MASS_TRUNCATION / 2, false);
  const right = Math.max(probs.length - prefixToTruncate(probs, TAIL_MASS_TRUNCATION / 2, true), left + 1);
  const leftMass = pairwiseSum(probs, 0, left, false);
  const rightMass = pairwiseSum(probs, right, probs.length - right, false);
  const kept = probs.slice(left, right);
  kept[0] += leftMass;
  return { losses: losses.slice(left, left + kept.length), probs: kept, infinityMass: infinityMass + rightMass };
}

/** `_get_epsilon_for_delta`: the smallest epsilon whose hockey-stick divergence is at most `delta`. */
function epsilonForDelta(pmf: SparsePmf, delta: number): number {
  if (pmf.infinityMass > delta) return Infinity;
  let massUpper = pmf.infinityMass;
  let massLower = 0;
  for (let i = pmf.losses.length - 1; i >= 0; i--) {
    const loss = pmf.losses[i] * PLD_DISCRETIZATION;
    if (massUpper > delta && massLower > 0 && Math.log((massUpper - delta) / massLower) >= loss) break;
    massUpper += pmf.probs[i];
    massLower += Math.exp(-loss) * pmf.probs[i];
    if (massUpper >= delta && massLower === 0) return Math.max(0, loss);
  }
  if (massUpper <= massLower + delta) return 0;
  return Math.log((massUpper - delta) / massLower);
}

/**
 * `eps(n)` at `delta` after `n` pure `epsilon`-DP releases, memoised (a generation asks for `n` and `n + 1`).
 * Throws NotImplementedInTypeScriptError where dp-accounting would compose densely.
 */
export function pureDpPldCurve(epsilon: number, delta: number): (releases: number) => number {
  const step = randomizedResponsePmf(epsilon);
  let pmf: SparsePmf = { losses: [0], probs: [1], infinityMass: 0 }; // the identity PLD
  const epsilons = [0.0];
  return (releases) => {
    while (epsilons.length <= releases) {
      if (pmf.losses.length * step.losses.length > MAX_SPARSE_SIZE) {
        throw new NotImplementedInTypeScriptError(
          `composing ${epsilons.length} pure_dp releases (epsilon ${pyG(epsilon)}) at delta ${pyG(delta)} takes ` +
            "dp-accounting's dense PLD (an FFT convolution), which the TypeScript SDK does not implement (a shorter " +
            "max_new_tokens, or the budget at delta 0)",
        );
      }
      pmf = compose(pmf, step);
      epsilons.push(epsilonForDelta(pmf, delta));
    }
    return epsilons[releases];
  };
}
