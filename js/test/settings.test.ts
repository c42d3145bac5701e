/**
 * Decode settings against the Python SDK's own: every field of Python's `DecodeSettings` is a setting here with the
 * same default (a new Python setting fails this file until it is added or refused), and each bad value is refused
 * with the typed error and the message Python gives (test/python_settings.py runs Python's checks; nothing here
 * computes an expected message with the code under test).
 */

import { execFileSync } from "node:child_process";
import { join } from "node:path";
import { beforeAll, describe, expect, it } from "vitest";
import {
  InvalidArgumentError,
  NotImplementedInTypeScriptError,
  UnknownSettingError,
} from "../src/core/errors.js";
import { DEFAULT_SETTINGS, decodeSettings, type DecodeSettings } from "../src/loop/settings.js";
import { PYTHON, REPO } from "./e2e/adapter.js";

type Case = { overrides: Record<string, unknown> };
interface PythonOutcome { type: "TypeError" | "ValueError"; message: string }
interface PythonSettings { fields: { name: string; default: unknown }[]; outcomes: (PythonOutcome | null)[] }

/** Python's exceptions for bad settings and the status the endpoint answers them with (edge_sdk/server/serving.py:
 * a `ValueError` or `TypeError` from the settings is a 400 `invalid_request_error`, gRPC's INVALID_ARGUMENT). */
const PYTHON_STATUS = { ValueError: "INVALID_ARGUMENT", TypeError: "INVALID_ARGUMENT" } as const;

/** Bad values, in Python's spelling, that Python's DecodeSettings refuses. */
const REFUSED_BY_PYTHON: Record<string, unknown>[] = [
  { pace_ms: -1 }, { pace_ms: 0 }, { pace_ms: "fast" }, { auto_pace_ms: -5 },
  { prefill_budget_ms: 0 }, { prefill_budget_ms: -2.5 },
  { exposure_budget: 1.5 }, { exposure_budget: -0.1 },
  { lookahead: -1 }, { lookahead: 1.5 }, { lookahead: "2" },
  { logprobs: 21 }, { logprobs: -1 },
  { mode: "sideways" }, { max_new_tokens: 0 }, { top_m: 2.5 }, { exposure_k: -3 }, { exposure_k: true },
  { alphaa: 1 }, { alphaa: 1, zeta: 2 },
];

const camel = (name: string) => name.replace(/_([a-z])/g, (_, c: string) => c.toUpperCase());
const camelOverrides = (o: Record<string, unknown>) => Object.fromEntries(Object.entries(o).map(([k, v]) => [camel(k), v]));

let python: PythonSettings;

beforeAll(() => {
  const cases: Case[] = [...REFUSED_BY_PYTHON.map((overrides) => ({ overrides })),
    { overrides: { pace_ms: "auto" } }, { overrides: { auto_pace_ms: "auto" } }];
  const stdout = execFileSync(PYTHON, [join(import.meta.dirname, "python_settings.py")],
    { cwd: REPO, input: JSON.stringify(cases), env: { ...process.env, PYTHONPATH: REPO } });
  python = JSON.parse(stdout.toString()) as PythonSettings;
}, 120_000);

function thrown(f: () => unknown): unknown {
  try {
    f();
  } catch (error) {
    return error;
  }
  throw new Error("expected an error");
}

describe("decode settings, as Python's DecodeSettings", () => {
  it("every Python setting is a setting here, spelt in camelCase, with Python's default", () => {
    const pythonNames = python.fields.map((f) => f.name);
    expect(pythonNames).toContain("lookahead"); // the run-ahead depth moved into DecodeSettings (issue 33)
    for (const { name, default: value } of python.fields) {
      const key = camel(name) as keyof DecodeSettings;
      expect(Object.keys(DEFAULT_SETTINGS), `Python's DecodeSettings.${name}: add it to DecodeSettings (same ` +
        "default and checks) or refuse it with NotImplementedInTypeScriptError").toContain(key);
      const ours = DEFAULT_SETTINGS[key];
      expect(typeof ours === "bigint" ? Number(ours) : ours, name).toEqual(value);
    }
    // and nothing here that Python does not have: the same settings, in the same order
    expect(Object.keys(DEFAULT_SETTINGS)).toEqual(pythonNames.map(camel));
  });

  it("a bad value is InvalidArgumentError (INVALID_ARGUMENT) with Python's message, naming the setting as Python does", () => {
    REFUSED_BY_PYTHON.forEach((overrides, i) => {
      const py = python.outcomes[i];
      expect(py, JSON.stringify(overrides)).not.toBeNull();
      const error = thrown(() => decodeSettings(camelOverrides(overrides) as Partial<DecodeSettings>));
      expect(error, JSON.stringify(overrides)).toBeInstanceOf(InvalidArgumentError);
      const { code, message } = error as InvalidArgumentError;
      expect(code).toBe(PYTHON_STATUS[py!.type]);
      if (py!.type === "TypeError") {
        // an unknown name: Python lists its fields in snake_case, this SDK in camelCase
        expect(error).toBeInstanceOf(UnknownSettingError);
        const listed = py!.message.replace(/\(DecodeSettings has: (.*)\)$/, (_, names: string) =>
          `(DecodeSettings has: ${names.split(", ").map(camel).join(", ")})`);
        expect(message).toBe(listed);
      } else {
        expect(message).toBe(py!.message);
      }
    });
  });

  it("'auto' paces, which Python measures on a public prompt, are UNIMPLEMENTED here, naming the setting", () => {
    for (const [i, name] of [[0, "pace_ms"], [1, "auto_pace_ms"]] as const) {
      expect(python.outcomes[REFUSED_BY_PYTHON.length + i]).toBeNull(); // Python accepts them
      const error = thrown(() => decodeSettings({ [camel(name)]: "auto" } as never)) as NotImplementedInTypeScriptError;
      expect(error).toBeInstanceOf(NotImplementedInTypeScriptError);
      expect(error.code).toBe("UNIMPLEMENTED");
      expect(error.message).toBe(`${name}='auto' (a pace measured once on a public prompt) is not implemented in ` +
        "the TypeScript SDK: give a pace in ms");
    }
  });

  it("a setting spelt as Python spells it is refused, naming the spelling here", () => {
    const error = thrown(() => decodeSettings({ max_new_tokens: 5, lookahead: 2 } as never)) as UnknownSettingError;
    expect(error).toBeInstanceOf(UnknownSettingError);
    expect(error.message).toBe("unknown decode setting max_new_tokens (DecodeSettings has: mode, alpha, maxNewTokens, " +
      "topM, temperature, seed, exposureK, exposureBudget, maxEpsilon, epsilonDelta, paceMs, autoPaceMs, " +
      "prefillBudgetMs, logprobs, lookahead; max_new_tokens is maxNewTokens here)");
  });

  it("good values pass through, defaults filled in", () => {
    expect(decodeSettings({ lookahead: 0, paceMs: 20, logprobs: 20, exposureBudget: 1 })).toMatchObject(
      { lookahead: 0, paceMs: 20, logprobs: 20, exposureBudget: 1, mode: "cloud", alpha: 0.3, autoPaceMs: 50 });
  });
});
