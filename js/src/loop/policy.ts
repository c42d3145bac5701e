/**
 * What the loop needs of a policy (Python: `edge_sdk.policies.base.Policy`), and the undefended reference the loop
 * is tested with until the core's registry of policies is merged in.
 */

import type { CloudUpload, FusionMode, FusionSpace, Signal, SyncedToken } from "../wire/index.js";

/** The uniform draws a randomised policy consumes, in [0, 1) (seed it from OS entropy, never from the wire). */
export type Rng = () => number;

export interface Policy {
  readonly name: string;
  readonly modes: ReadonlySet<FusionMode>;
  /** the policy's arrays are probabilities ("prob") or logits ("logit") */
  readonly space: FusionSpace;
  /** The one signal that leaves the device for the step (p_slm, p_llm in the policy's space). */
  decide(mode: FusionMode, pSlm: Float32Array, pLlm: Float32Array, options: { alpha: number; rng?: Rng }): Signal;
  /** Whether the decision reads the cloud's whole row (then asked for at every step: the policy and mode decide). */
  needsFullRow(mode: FusionMode): boolean;
  /** The most values one cloud-side upload holds: a public number (every padded signal is the size of the largest). */
  maxUpload(vocabSize: number): number;
  /** This policy calibrated for a generation of `maxNewTokens` tokens. */
  forGeneration(maxNewTokens: number): Policy;
  /** A short label with the policy's parameters, for ledgers. */
  describe(): string;
}

/** `alpha * p_llm + (1 - alpha) * p_slm` in float32, as numpy computes it (each product and the sum rounded). */
export function fuse(pLlm: Float32Array, pSlm: Float32Array, alpha: number, out?: Float32Array): Float32Array {
  const row = out ?? new Float32Array(pLlm.length);
  const a = Math.fround(alpha);
  const b = Math.fround(1 - alpha);
  for (let i = 0; i < row.length; i++) row[i] = Math.fround(pLlm[i] * a) + Math.fround(pSlm[i] * b);
  return row;
}

/** The first id of the largest value. */
export function argmax(values: ArrayLike<number>): number {
  let best = 0;
  for (let i = 1; i < values.length; i++) if (values[i] > values[best]) best = i;
  return best;
}

/** No defence (Python: `edge_sdk.policies.undefended.Undefended`, greedy): cloud-side the whole p_slm is uploaded,
 * edge-side `argmax(alpha * p_llm + (1 - alpha) * p_slm)` is sent. */
export class Undefended implements Policy {
  readonly name = "undefended";
  readonly modes: ReadonlySet<FusionMode> = new Set<FusionMode>(["cloud", "edge"]);

  constructor(readonly space: FusionSpace = "prob") {}

  decide(mode: FusionMode, pSlm: Float32Array, pLlm: Float32Array, { alpha }: { alpha: number }): Signal {
    if (mode === "cloud") {
      return { kind: "upload", ids: Int32Array.from(pSlm.keys()), values: pSlm.slice() } satisfies CloudUpload;
    }
    return { kind: "token", tokenId: argmax(fuse(pLlm, pSlm, alpha)) } satisfies SyncedToken;
  }

  needsFullRow(): boolean {
    return false; // cloud-side it ignores p_llm; greedy edge-side it reads only the fused top id
  }

  maxUpload(vocabSize: number): number {
    return vocabSize;
  }

  forGeneration(): Policy {
    return this;
  }

  describe(): string {
    return this.space === "prob" ? "undefended(temperature=0.0)" : `undefended(temperature=0.0, space=${this.space})`;
  }
}
