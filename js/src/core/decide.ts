/**
 * The decide step of one generation (Python: the decide step of `edge_sdk.decoding.CollaborativeDecoder`): the
 * SLM's row with its `never_upload` ids removed, the cloud's row at its public fill, the policy's signal (or a
 * cloud-only one once a budget is spent), the full-upload cut, DecodeLeak's `E_t^K`, and the accountant and
 * exposure budget that count what was released.  The loop drives it; it sends nothing itself.
 */

import { type CloudDistribution } from "./distribution.js";
import { InvalidArgumentError } from "./errors.js";
import { argmax, checkAlpha, type Draws, fuse, lowestOf } from "./fusion.js";
import { CloudUpload, type FusionMode, type Observation, type Policy, SyncedToken } from "../policies/base.js";
import { PrivacyAccountant } from "../privacy/accountant.js";
import { ExposureBudget } from "../privacy/budget.js";
import { PrivacyLedger } from "../privacy/ledger.js";
import { FULL_UPLOAD_LIMIT, slmView } from "../privacy/masking.js";

/** The public settings the decide step reads (names as Python's `DecodeSettings`). */
export interface DecideSettings {
  mode: FusionMode;
  /** The cloud LLM's weight in the fusion (the paper's 0.3). */
  alpha: number;
  maxNewTokens: number;
  /** K of the per-step exposure set `E_t^K`. */
  exposureK: number;
  /** Share of steps the private context may steer (`null`: no budget). */
  exposureBudget: number | null;
  /** Privacy budget of the DP policies (`null`: none). */
  maxEpsilon: number | null;
  /** The delta `maxEpsilon` is stated at (`null`: the policy's). */
  epsilonDelta: number | null;
}

export const DEFAULT_DECIDE_SETTINGS: DecideSettings = {
  mode: "cloud", alpha: 0.3, maxNewTokens: 256, exposureK: 100, exposureBudget: null, maxEpsilon: null,
  epsilonDelta: null,
};

/** What the decide step settled: `signal` leaves the device; `exposure` is `E_t^K`; `fused` the row it read. */
export interface StepDecision {
  signal: Observation;
  exposure: number[];
  fused: () => Float32Array;
}

/** DecodeLeak's `E_t^K` of one step: `TopK` of the uploaded values, or (edge-side) the cloud's own `TopK`. */
export function stepExposure(signal: Observation, dist: CloudDistribution, k: number): number[] {
  return signal instanceof CloudUpload ? signal.exposure(k) : dist.topIds(k);
}

export class StepDecider {
  readonly policy: Policy;
  readonly settings: DecideSettings;
  readonly masked: Int32Array;
  readonly accountant: PrivacyAccountant;
  readonly budget: ExposureBudget;
  readonly ledger: PrivacyLedger;
  readonly lowest: number;

  constructor(
    policy: Policy,
    settings: Partial<DecideSettings> & Pick<DecideSettings, "mode">,
    readonly vocabSize: number,
    maskedIds: Iterable<number> = [],
    readonly draws?: Draws,
  ) {
    this.settings = { ...DEFAULT_DECIDE_SETTINGS, ...settings };
    checkAlpha(this.settings.alpha);
    if (!policy.modes.has(this.settings.mode)) {
      throw new InvalidArgumentError(`policy '${policy.name}' does not support ${this.settings.mode}-side fusion`);
    }
    this.policy = policy.forGeneration(this.settings.maxNewTokens);
    this.accountant = new PrivacyAccountant(this.policy.releaseEvent(this.settings.mode), {
      delta: this.settings.epsilonDelta, maxEpsilon: this.settings.maxEpsilon, horizon: this.settings.maxNewTokens,
    });
    this.budget = new ExposureBudget(this.settings.exposureBudget, this.accountant);
    this.ledger = new PrivacyLedger(this.settings.mode, this.policy.describe(), this.settings.exposureK,
      this.accountant);
    this.masked = Int32Array.from([...new Set(maskedIds)].sort((x, y) => x - y));
    for (const id of this.masked) {
      if (id < 0 || id >= vocabSize) throw new InvalidArgumentError(`masked id ${id} is outside [0, ${vocabSize})`);
    }
    this.lowest = lowestOf(this.policy.space);
  }

  /** The SLM's logits as the policy reads them, masked ids removed. */
  view(logits: Float32Array): Float32Array {
    return slmView(logits.subarray(0, this.vocabSize), this.policy.space, this.masked);
  }

  /** Whether `step` is withheld by a budget (public numbers and the release count only). */
  withholds(step: number, maxSteps: number): boolean {
    return this.budget.withholds(step, maxSteps);
  }

  /**
   * The step's decision from the SLM's (viewed) row and the cloud's, or `null` when the policy reads full rows
   * and `dist` is sparse (the loop then asks for the full row).  `stops` (edge-side `no_stop`): end ids out of
   * the choice this step.
   */
  decide(slmRow: Float32Array, dist: CloudDistribution, withheld: boolean, stops: number[] | null = null):
    StepDecision | null {
    const { mode, alpha, exposureK } = this.settings;
    const edgeStops = stops !== null && mode === "edge" ? stops : null;
    let signal: Observation;
    let fused: () => Float32Array;
    if (withheld) {
      const cloudRow = (): Float32Array => this.restrict(dist.filled(this.vocabSize, this.policy.space), edgeStops);
      if (mode === "cloud") {
        signal = CloudUpload.empty(this.policy.space);
      } else {
        let token = dist.topId();
        if (edgeStops !== null && edgeStops.includes(token)) {
          token = argmax(this.restrict(dist.lowerDense(this.vocabSize, this.lowest), edgeStops));
        }
        signal = new SyncedToken(token);
      }
      fused = cloudRow;
    } else if (!dist.isFull && this.policy.needsFullRow(mode)) {
      return null;
    } else {
      const pSlm = this.restrict(slmRow, edgeStops);
      const pLlm = this.restrict(dist.filled(this.vocabSize, this.policy.space), edgeStops);
      signal = this.policy.decide(mode, pSlm, pLlm, alpha, this.draws);
      if (signal instanceof CloudUpload && signal.length >= this.vocabSize &&
        (this.policy.space === "prob" || this.masked.length > 0)) {
        signal = signal.largest(FULL_UPLOAD_LIMIT); // every id listed: masked ones (at the floor) would stand out
      }
      fused = () => fuse(pLlm, pSlm, alpha);
    }
    return { signal, exposure: stepExposure(signal, dist, exposureK), fused };
  }

  /** A decided, not withheld, signal: the accountant's event. */
  recordRelease(step: number, signal: Observation, dist: CloudDistribution): void {
    this.budget.recordRelease(step, signal, dist);
  }

  /** Count an acknowledged step if the cloud can tell the private context steered it; whether it did. */
  countSteered(signal: Observation, dist: CloudDistribution): boolean {
    return this.budget.countSteered(signal, dist);
  }

  /** `row` with the stop ids at the space's lowest value (a copy when any). */
  private restrict(row: Float32Array, stops: number[] | null): Float32Array {
    if (stops === null) return row;
    const out = Float32Array.from(row);
    for (const id of stops) if (id < out.length) out[id] = this.lowest;
    return out;
  }
}
