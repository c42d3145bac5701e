/**
 * When a step may send only a signal the cloud could produce alone (Python: `edge_sdk.steps.ExposureBudget`):
 * at most `floor(share * maxSteps)` steps may be steered by the private context, beside the accountant's epsilon
 * budget.  Both read public numbers and counts the cloud can keep itself, never the private context.
 */

import type { CloudDistribution } from "../core/distribution.js";
import { CloudUpload, type Observation } from "../policies/base.js";
import type { PrivacyAccountant } from "./accountant.js";

/**
 * Whether the private context steered this step's signal, as the cloud itself can tell: cloud-side anything was
 * uploaded; edge-side the token is not the cloud's own top token.
 */
export function isSteered(signal: Observation, dist: CloudDistribution): boolean {
  if (signal instanceof CloudUpload) return signal.length > 0;
  return signal.tokenId !== dist.topId();
}

export class ExposureBudget {
  steeredSteps = 0;

  constructor(readonly share: number | null, readonly accountant: PrivacyAccountant) {}

  /** Whether `step` is withheld: one more steered step must keep the share within the budget, or the epsilon
   * budget is spent. */
  withholds(step: number, maxSteps: number): boolean {
    const overShare = this.share !== null && this.steeredSteps + 1 > this.share * maxSteps;
    return this.accountant.withholds(step) || overShare;
  }

  /** A signal decided from the private context: the accountant's event (recorded when decided). */
  recordRelease(step: number, signal: Observation, dist: CloudDistribution): void {
    this.accountant.record(step, isSteered(signal, dist));
  }

  /** Count an acknowledged step if the cloud can tell the private context steered it; whether it did. */
  countSteered(signal: Observation, dist: CloudDistribution): boolean {
    const steered = isSteered(signal, dist);
    if (steered) this.steeredSteps += 1;
    return steered;
  }
}
