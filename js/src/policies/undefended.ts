/** The undefended reference (Python: `edge_sdk.policies.undefended`): the fusion leakage is measured from. */

import { checkSpace, type Draws, fuse, type FusionSpace, pickToken, softmax } from "../core/fusion.js";
import { CloudUpload, type Described, type FusionMode, Policy, SyncedToken } from "./base.js";

/**
 * No defence: cloud-side the whole `p_slm` is uploaded; edge-side `argmax(alpha * p_llm + (1 - alpha) * p_slm)`
 * is synchronised, or a draw from it at `temperature > 0` (logit space: from the fused logits' softmax).
 */
export class Undefended extends Policy {
  readonly name = "undefended";
  readonly modes: ReadonlySet<FusionMode> = new Set<FusionMode>(["cloud", "edge"]);
  override readonly space: FusionSpace;
  readonly temperature: number;

  constructor(params: { temperature?: number; space?: FusionSpace } = {}) {
    super();
    this.temperature = params.temperature ?? 0.0;
    this.space = checkSpace(params.space ?? "prob");
  }

  protected parameters(): [string, Described][] {
    return [["temperature", { float: this.temperature }]];
  }

  override llmSupport(mode: FusionMode): number | null {
    if (mode === "cloud") return 0;
    return this.temperature === 0 ? 1 : null;
  }

  override cloudUpload(pSlm: Float32Array): CloudUpload {
    const ids = new Int32Array(pSlm.length);
    for (let i = 0; i < ids.length; i++) ids[i] = i;
    return new CloudUpload(ids, pSlm, this.space);
  }

  override edgeToken(pSlm: Float32Array, pLlm: Float32Array, alpha: number, draws?: Draws): SyncedToken {
    let fused = fuse(pLlm, pSlm, alpha);
    if (this.space === "logit" && this.temperature > 0) fused = softmax(fused);
    return new SyncedToken(pickToken(fused, this.temperature, draws));
  }
}
