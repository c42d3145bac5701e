/** CoGenesis (Zhang et al., ACL 2024), cloud-side: upload the SLM's top-`B` probabilities as they are. */

import { topKIds } from "../core/fusion.js";
import { checkPositiveInt } from "../privacy/accounting.js";
import { CloudUpload, type Described, type FusionMode, Policy } from "./base.js";

/** CoGenesis' support: `TopB(p_slm)` (`min(B, V)` ids, ascending); the values are not renormalised. */
export function cogenesisUploadIds(pSlm: Float32Array, b: number): number[] {
  return topKIds(pSlm, checkPositiveInt(b, "CoGenesis upload size B")).sort((x, y) => x - y);
}

export class CoGenesis extends Policy {
  readonly name = "cogenesis";
  readonly modes: ReadonlySet<FusionMode> = new Set<FusionMode>(["cloud"]);
  readonly b: number;

  constructor(params: { b?: number } = {}) {
    super();
    this.b = checkPositiveInt(params.b ?? 10, "CoGenesis upload size B");
  }

  protected parameters(): [string, Described][] {
    return [["b", { int: this.b }]];
  }

  override maxUpload(vocabSize: number): number {
    return Math.min(this.b, vocabSize);
  }

  override llmSupport(): number {
    return 0;
  }

  override cloudUpload(pSlm: Float32Array): CloudUpload {
    return CloudUpload.of(pSlm, cogenesisUploadIds(pSlm, this.b));
  }
}
