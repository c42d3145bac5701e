/**
 * What a policy decides and what the cloud observes, as Python's `edge_sdk.policies.base`.
 *
 * A policy runs on the edge once per step.  Given the SLM's row (`p_slm`, private context + public query) and
 * the cloud's (`p_llm`, public query only) it produces the one message that leaves the device: cloud-side a
 * {@link CloudUpload} (sparse SLM values the cloud fuses), edge-side a {@link SyncedToken} (fused on the device).
 */

import { InvalidArgumentError, UnsupportedModeError } from "../core/errors.js";
import { pyRepr, pyValueRepr } from "../core/format.js";
import { type Draws, type FusionSpace, topKIds } from "../core/fusion.js";
import { ReleaseEvent } from "../privacy/accountant.js";

export type FusionMode = "cloud" | "edge";
export const FUSION_MODES: readonly FusionMode[] = ["cloud", "edge"];

/** `mode` if it is a fusion mode, else `InvalidArgumentError` (Python: `Policy.decide`'s message). */
export function checkFusionMode(mode: unknown): FusionMode {
  if (mode === "cloud" || mode === "edge") return mode;
  throw new InvalidArgumentError(`fusion mode must be one of ('cloud', 'edge'), got ${pyValueRepr(mode)}`);
}

/** A sparse upload of SLM values: the cloud observes exactly `(ids, values)`, ids unique and ascending. */
export class CloudUpload {
  readonly ids: Int32Array;
  readonly values: Float32Array;

  constructor(ids: ArrayLike<number>, values: ArrayLike<number>, readonly space: FusionSpace = "prob") {
    if (ids.length !== values.length) {
      throw new InvalidArgumentError(`upload has ${ids.length} ids but ${values.length} values`);
    }
    let ascending = true;
    for (let j = 1; j < ids.length && ascending; j++) ascending = ids[j] > ids[j - 1];
    if (ascending) {
      this.ids = Int32Array.from(ids);
      this.values = Float32Array.from(values);
      return;
    }
    const order = Array.from({ length: ids.length }, (_, j) => j).sort((x, y) => (ids[x] - ids[y]) || (x - y));
    this.ids = Int32Array.from(order, (j) => ids[j]);
    this.values = Float32Array.from(order, (j) => values[j]);
    for (let j = 1; j < this.ids.length; j++) {
      if (this.ids[j] === this.ids[j - 1]) throw new InvalidArgumentError("upload ids must be unique");
    }
  }

  /** Upload `p` restricted to `ids`. */
  static of(p: Float32Array, ids: ArrayLike<number>, space: FusionSpace = "prob"): CloudUpload {
    return new CloudUpload(ids, Array.from(ids, (id) => p[id]), space);
  }

  static empty(space: FusionSpace = "prob"): CloudUpload {
    return new CloudUpload([], [], space);
  }

  get length(): number {
    return this.ids.length;
  }

  /** This upload, or only its `limit` largest values when it holds more. */
  largest(limit: number): CloudUpload {
    if (this.length <= limit) return this;
    const keep = topKIds(this.values, limit);
    return new CloudUpload(keep.map((j) => this.ids[j]), keep.map((j) => this.values[j]), this.space);
  }

  /** `TopK` of the uploaded values (ids by decreasing value): DecodeLeak's `E_t^K`. */
  exposure(k: number): number[] {
    if (this.length === 0) return [];
    return topKIds(this.values, Math.min(k, this.length)).map((j) => this.ids[j]);
  }
}

/** Edge-side fusion: the one token id appended to the shared prefix. */
export class SyncedToken {
  constructor(readonly tokenId: number) {}
}

export type Observation = CloudUpload | SyncedToken;

/** A parameter as `describe()` writes it: a Python float, an int, a string or `None`. */
export type Described = { float: number } | { int: number } | { text: string } | null;

/** Base class of every defence (and of the undefended reference). */
export abstract class Policy {
  abstract readonly name: string;
  abstract readonly modes: ReadonlySet<FusionMode>;
  /** Inputs are probabilities ("prob") or logits ("logit"). */
  readonly space: FusionSpace = "prob";

  /** What one step's signal costs in privacy; the default: none of it is DP. */
  releaseEvent(_mode: FusionMode): ReleaseEvent {
    return ReleaseEvent.nonPrivate(
      `${this.name} is a heuristic with no DP guarantee: DecodeLeak measures its protection empirically`,
    );
  }

  /** This policy calibrated for a generation of `maxNewTokens` tokens (itself unless a budget is spread). */
  forGeneration(_maxNewTokens: number): Policy {
    return this;
  }

  /** How much of `p_llm` the decision reads: 0 none, `k` its top `k`, `null` the whole row. */
  llmSupport(_mode: FusionMode): number | null {
    return null;
  }

  /** The most values one cloud-side upload holds (a public number its rule fixes). */
  maxUpload(vocabSize: number): number {
    return vocabSize;
  }

  /** Whether the decision reads the cloud's whole row (the edge then asks for it at every step). */
  needsFullRow(mode: FusionMode): boolean {
    return this.llmSupport(mode) === null;
  }

  /** Choose what of `pSlm` to upload for cloud-side fusion. */
  cloudUpload(_pSlm: Float32Array, _pLlm: Float32Array, _alpha: number, _draws?: Draws): CloudUpload {
    throw new UnsupportedModeError(`policy '${this.name}' does not define cloud-side fusion`);
  }

  /** Choose the token to synchronise for edge-side fusion. */
  edgeToken(_pSlm: Float32Array, _pLlm: Float32Array, _alpha: number, _draws?: Draws): SyncedToken {
    throw new UnsupportedModeError(`policy '${this.name}' does not define edge-side fusion`);
  }

  /** Dispatch to {@link cloudUpload} or {@link edgeToken} by fusion mode. */
  decide(mode: FusionMode, pSlm: Float32Array, pLlm: Float32Array, alpha: number, draws?: Draws): Observation {
    if (mode === "cloud") return this.cloudUpload(pSlm, pLlm, alpha, draws);
    checkFusionMode(mode);
    return this.edgeToken(pSlm, pLlm, alpha, draws);
  }

  /** The policy's parameters in their declaration order, as `describe()` lists them. */
  protected abstract parameters(): [string, Described][];

  /** A short label with the policy's parameters: `coveil(lam=1.0, k=50)`, as Python writes it. */
  describe(): string {
    const shown: [string, Described][] = this.space === "prob" ? [] : [["space", { text: this.space }]];
    const params = [...shown, ...this.parameters()].map(([key, value]) => `${key}=${describeValue(value)}`);
    return params.length ? `${this.name}(${params.join(", ")})` : this.name;
  }
}

function describeValue(value: Described): string {
  if (value === null) return "None";
  if ("float" in value) return pyRepr(value.float);
  if ("int" in value) return String(value.int);
  return value.text;
}

/** Randomised mechanisms refuse to run on hidden global randomness. */
export function requireDraws(draws: Draws | undefined, policy: string): Draws {
  if (draws === undefined) {
    throw new InvalidArgumentError(`policy '${policy}' is randomised: pass explicit draws`);
  }
  return draws;
}
