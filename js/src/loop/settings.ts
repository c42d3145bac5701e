/**
 * Every decode default, written once (Python: `edge_sdk.decode_settings.DecodeSettings`, same names in camelCase
 * and the same defaults); a call overrides a copy, and a name that is not a setting is refused.
 */

import type { FusionMode } from "../policies/base.js";

export interface DecodeSettings {
  /** fusion mode: "cloud" (the cloud fuses and picks) or "edge" */
  mode: FusionMode;
  /** the cloud LLM's weight in p = alpha * p_llm + (1 - alpha) * p_slm */
  alpha: number;
  maxNewTokens: number;
  /** the cloud's values per sparse step unless the edge needs more */
  topM: number;
  /** cloud-side sampling temperature when the cloud picks (0: greedy) */
  temperature: number;
  /** the cloud's sampling seed (cloud-side fusion only); the edge never uses it */
  seed: bigint;
  /** DecodeLeak's K of the per-step exposure set E_t^K */
  exposureK: number;
  /** share of steps the private context may steer (0..1) */
  exposureBudget: number | null;
  /** privacy budget of the DP policies (epsilon) */
  maxEpsilon: number | null;
  epsilonDelta: number | null;
  /** send each step's signal on a fixed grid of this many ms */
  paceMs: number | null;
  /** with no paceMs, send each run-ahead or cloud-side signal over a network on a grid of this many ms */
  autoPaceMs: number | null;
  /** open each session on a grid of this many ms from when the generation began */
  prefillBudgetMs: number | null;
  /** log-probabilities of each token and of this many best alternatives (0-20) */
  logprobs: number | null;
}

export const DEFAULT_SETTINGS: Readonly<DecodeSettings> = Object.freeze({
  mode: "cloud",
  alpha: 0.3,
  maxNewTokens: 256,
  topM: 256,
  temperature: 0,
  seed: 0n,
  exposureK: 100,
  exposureBudget: null,
  maxEpsilon: null,
  epsilonDelta: null,
  paceMs: null,
  autoPaceMs: 50,
  prefillBudgetMs: null,
  logprobs: null,
});

const positive = ["paceMs", "autoPaceMs", "prefillBudgetMs"] as const;
const positiveIntegers = ["maxNewTokens", "topM", "exposureK"] as const;

/** The defaults with `overrides` applied, checked as Python checks them (`RangeError`/`TypeError` naming the
 * parameter). */
export function decodeSettings(overrides: Partial<DecodeSettings> = {}): DecodeSettings {
  const known = Object.keys(DEFAULT_SETTINGS);
  const unknown = Object.keys(overrides).filter((name) => !known.includes(name)).sort();
  if (unknown.length) {
    throw new TypeError(`unknown decode setting${unknown.length > 1 ? "s" : ""} ${unknown.join(", ")} ` +
      `(DecodeSettings has: ${known.join(", ")})`);
  }
  const s: DecodeSettings = { ...DEFAULT_SETTINGS, ...overrides };
  if (s.mode !== "cloud" && s.mode !== "edge") throw new RangeError(`mode must be 'cloud' or 'edge', got ${s.mode}`);
  for (const name of positive) {
    const value = s[name];
    if (value !== null && !(value > 0)) throw new RangeError(`${snake(name)} must be positive (or None for none), got ${value}`);
  }
  for (const name of positiveIntegers) {
    if (!Number.isInteger(s[name]) || s[name] <= 0) throw new RangeError(`${snake(name)} must be a positive integer, got ${s[name]}`);
  }
  if (s.exposureBudget !== null && !(s.exposureBudget >= 0 && s.exposureBudget <= 1)) {
    throw new RangeError(`exposure_budget must lie in [0, 1], got ${s.exposureBudget}`);
  }
  if (s.logprobs !== null && !(Number.isInteger(s.logprobs) && s.logprobs >= 0 && s.logprobs <= 20)) {
    throw new RangeError(`logprobs must lie in 0..20 (or None for none), got ${s.logprobs}`);
  }
  return s;
}

/** `maxNewTokens` -> `max_new_tokens`: errors name a setting as Python's do. */
function snake(name: string): string {
  return name.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`);
}
