/** Every registered policy by name, as Python's `edge_sdk.policies` registry (each one implemented here). */

import { InvalidArgumentError, NotImplementedInTypeScriptError, UnknownNameError } from "../core/errors.js";
import type { SLMBackend } from "../backends/base.js";
import { type FusionMode, Policy } from "./base.js";
import { CoGenesis } from "./cogenesis.js";
import { CoVeil } from "./coveil.js";
import { CusText } from "./custext.js";
import { DPFusion } from "./dp_fusion.js";
import { DPLogit } from "./dp_logit.js";
import { InvisibleInk } from "./invisible_ink.js";
import { LDPSampler } from "./ldp_sampler.js";
import { Undefended } from "./undefended.js";

export * from "./base.js";
export * from "./cogenesis.js";
export * from "./coveil.js";
export * from "./custext.js";
export * from "./dp_fusion.js";
export * from "./dp_logit.js";
export * from "./invisible_ink.js";
export * from "./ldp_sampler.js";
export * from "./undefended.js";

type Kind = "int" | "optional_int" | "float" | "space" | "text" | "neighbours";

interface Entry {
  modes: readonly FusionMode[];
  params: Record<string, Kind>;
  build: (params: Record<string, unknown>) => Policy;
}

/** Each policy with its modes and each parameter's type (as Python's dataclass fields). */
const IMPLEMENTED: Record<string, Entry> = {
  undefended: { modes: ["cloud", "edge"], params: { temperature: "float", space: "space" },
    build: (p) => new Undefended(p) },
  coveil: { modes: ["cloud", "edge"], params: { lam: "float", k: "int", space: "space" },
    build: (p) => new CoVeil(p) },
  cogenesis: { modes: ["cloud"], params: { b: "int" }, build: (p) => new CoGenesis(p) },
  dp_logit: { modes: ["cloud"], params: { epsilon: "float", delta: "float", upload_k: "int" },
    build: (p) => new DPLogit(p) },
  invisible_ink: { modes: ["edge"], params: { epsilon: "float", delta: "float", top_k: "optional_int",
    temperature: "float", max_new_tokens: "int" }, build: (p) => new InvisibleInk(p) },
  custext: { modes: ["edge"], params: { neighbours: "neighbours", epsilon: "float", n_neighbours: "int",
    mapping: "text" }, build: (p) => new CusText(p) },
  dp_fusion: { modes: ["cloud", "edge"], params: { epsilon: "float", order: "float", delta: "float",
    max_new_tokens: "int", upload_k: "int" }, build: (p) => new DPFusion(p) },
  ldp_sampler: { modes: ["edge"], params: { epsilon: "float", gamma: "float" }, build: (p) => new LDPSampler(p) },
};

/** Every name Python registers, sorted. */
export function registeredPolicies(): string[] {
  return Object.keys(IMPLEMENTED).sort();
}

/** The policies this SDK implements, optionally only those that define `mode`. */
export function availablePolicies(mode?: FusionMode): string[] {
  return Object.keys(IMPLEMENTED).filter((name) => mode === undefined || IMPLEMENTED[name].modes.includes(mode)).sort();
}

function typed(policy: string, name: string, kind: Kind, value: unknown): unknown {
  if (kind === "space" || kind === "text" || kind === "neighbours" || (kind === "optional_int" && value === null)) {
    return value;
  }
  if (typeof value !== "number") {
    throw new InvalidArgumentError(`${policy} parameter ${name} must be a number, got ${JSON.stringify(value)}`);
  }
  if (kind !== "float" && !Number.isInteger(value)) {
    throw new InvalidArgumentError(`${policy} parameter ${name} must be an integer, got ${value}`);
  }
  return value;
}

/**
 * Instantiate a registered policy by name with its parameters (names and types checked as Python checks them).
 * `backend` is Python's `make_policy(name, backend=slm)`: a policy that builds itself from the edge model. The one
 * that does, CusText (the model's token embeddings), is not implemented over a backend here: pass `neighbours`.
 */
export function makePolicy(name: string, params: Record<string, unknown> = {}, backend?: SLMBackend): Policy {
  const entry = IMPLEMENTED[name];
  if (entry === undefined) {
    throw new UnknownNameError(`unknown policy '${name}' (available: ${registeredPolicies().join(", ")})`);
  }
  if (backend !== undefined && name === "custext" && params.neighbours === undefined) {
    throw new NotImplementedInTypeScriptError("CusText over the edge model's own token embeddings (Python: " +
      "make_policy('custext', backend=slm)) is not implemented in the TypeScript SDK: pass neighbours, an " +
      "EmbeddingNeighbours of the model's token embeddings");
  }
  const accepted = Object.keys(entry.params);
  const checked: Record<string, unknown> = {};
  for (const [key, value] of Object.entries(params)) {
    if (!(key in entry.params)) {
      throw new InvalidArgumentError(`policy ${name} has no parameter '${key}' (its parameters: ${accepted.join(", ")})`);
    }
    checked[key] = typed(name, key, entry.params[key], value);
  }
  return entry.build(checked);
}
