/**
 * Every decode default, written once (Python: `edge_sdk.decode_settings.DecodeSettings`, same names in camelCase
 * and the same defaults); a call overrides a copy, and a name that is not a setting is refused.
 */

import { InvalidArgumentError, NotImplementedInTypeScriptError, UnknownSettingError } from "../core/errors.js";
import { pyValueRepr } from "../core/format.js";
import { MAX_TOP_LOGPROBS } from "../core/logprobs.js";
import { checkFusionMode, type FusionMode } from "../policies/base.js";

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
  /** run-ahead: the deepest this generation accepts (rows the cloud drafts past the last confirmed token); 0:
   * lockstep; null: the connection's (`new CloudConnection(channel, lookahead)`, which a value here overrides).
   * What the edge sends is the same either way. */
  lookahead: number | null;
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
  lookahead: null,
});

const positiveIntegers = ["maxNewTokens", "topM", "exposureK"] as const;
/** Python's `AUTO`: a pace the Python client measures once on a public prompt; not implemented here. */
const AUTO = "auto";

/**
 * The defaults with `overrides` applied, checked as Python's `DecodeSettings` checks them: `InvalidArgumentError`
 * (`INVALID_ARGUMENT`, Python's `ValueError`) with Python's message, naming the setting in Python's spelling;
 * `UnknownSettingError` for a name that is not a setting (Python's `TypeError`); `NotImplementedInTypeScriptError`
 * (`UNIMPLEMENTED`) for a value Python accepts and this SDK does not implement (`"auto"` paces).  Checked in
 * Python's order: the mode, the counts, the clocks, the budget, lookahead, logprobs.
 */
export function decodeSettings(overrides: Partial<DecodeSettings> = {}): DecodeSettings {
  const known = Object.keys(DEFAULT_SETTINGS);
  const unknown = Object.keys(overrides).filter((name) => !known.includes(name)).sort();
  if (unknown.length) {
    const spelt = unknown.filter((name) => known.includes(camel(name))).map((name) => `${name} is ${camel(name)}`);
    throw new UnknownSettingError(`unknown decode setting${unknown.length > 1 ? "s" : ""} ${unknown.join(", ")} ` +
      `(DecodeSettings has: ${known.join(", ")}${spelt.length ? `; ${spelt.join(", ")} here` : ""})`);
  }
  const s: DecodeSettings = { ...DEFAULT_SETTINGS, ...overrides };
  checkFusionMode(s.mode);
  for (const name of positiveIntegers) {
    if (!Number.isInteger(s[name]) || s[name] <= 0) {
      throw new InvalidArgumentError(`${snake(name)} must be a positive integer, got ${pyValueRepr(s[name])}`);
    }
  }
  for (const [name, what] of [["paceMs", "no pacing"], ["autoPaceMs", "none"]] as const) {
    const value: unknown = s[name];
    if (value === AUTO) {
      throw new NotImplementedInTypeScriptError(`${snake(name)}='auto' (a pace measured once on a public prompt) is ` +
        "not implemented in the TypeScript SDK: give a pace in ms");
    }
    if (value !== null && !(typeof value === "number" && value > 0)) {
      throw new InvalidArgumentError(`${snake(name)} must be positive, 'auto' (or None for ${what}), got ${pyValueRepr(value)}`);
    }
  }
  if (s.prefillBudgetMs !== null && !(s.prefillBudgetMs > 0)) {
    throw new InvalidArgumentError(`prefill_budget_ms must be positive (or None for none), got ${pyValueRepr(s.prefillBudgetMs)}`);
  }
  if (s.exposureBudget !== null && !(s.exposureBudget >= 0 && s.exposureBudget <= 1)) {
    throw new InvalidArgumentError(`exposure_budget must lie in [0, 1], got ${pyValueRepr(s.exposureBudget)}`);
  }
  if (s.lookahead !== null && !(Number.isInteger(s.lookahead) && s.lookahead >= 0)) {
    throw new InvalidArgumentError("lookahead must be an integer of 0 (lockstep) or more (or None for the client's " +
      `default), got ${pyValueRepr(s.lookahead)}`);
  }
  if (s.logprobs !== null && !(Number.isInteger(s.logprobs) && s.logprobs >= 0 && s.logprobs <= MAX_TOP_LOGPROBS)) {
    throw new InvalidArgumentError(`logprobs must lie in 0..${MAX_TOP_LOGPROBS} (or None for none), got ${pyValueRepr(s.logprobs)}`);
  }
  return s;
}

/** `maxNewTokens` -> `max_new_tokens`: errors name a setting as Python's do. */
function snake(name: string): string {
  return name.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`);
}

/** `max_new_tokens` -> `maxNewTokens`: a setting spelt as Python spells it is named as it is spelt here. */
function camel(name: string): string {
  return name.replace(/_([a-z])/g, (_, c: string) => c.toUpperCase());
}
