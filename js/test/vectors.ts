/** Reading the golden vectors the Python SDK writes (`tests/conformance/vectors.json`). */

import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import type { Draws } from "../src/core/fusion.js";

export const VECTORS_PATH = fileURLToPath(new URL("../../tests/conformance/vectors.json", import.meta.url));

export interface DistJson {
  dense?: string;
  ids?: number[];
  values?: string;
  tail_bound?: string;
  tail_mass?: string;
}

export interface StepJson {
  slm_logits: string;
  slm_probs?: string;
  cloud: DistJson;
  no_stop: boolean;
  full?: string;
  draws: [string, string | string[]][];
  expect: {
    withheld: boolean;
    full_requested: boolean;
    signal: "upload" | "token";
    ids?: number[];
    values?: string;
    token_id?: number;
    exposure: number[];
    steered: boolean;
    released: boolean;
    epsilon: string;
    source_epsilon: string | null;
    leak_share: string;
    /** edge-side: the token's log-probability and the fused row's best ids with theirs (float64 hex) */
    logprobs?: { logprob: string; top: [number, string][] };
  };
}

export interface CaseJson {
  name: string;
  policy: string;
  params: Record<string, unknown>;
  describe: string;
  mode: "cloud" | "edge";
  space: "prob" | "logit";
  alpha: string;
  vocab_size: number;
  exposure_k: number;
  exposure_budget: number | null;
  max_epsilon: number | null;
  max_new_tokens: number;
  masked_ids: number[];
  /** top log-probabilities asked for (edge-side cases), else null */
  logprobs: number | null;
  /** the delta the ledger states epsilon at (null: the policy's own) */
  epsilon_delta: number | null;
  stop_ids: number[];
  private_content_ids: number[];
  embeddings: { rows: number; dim: number; values: string } | null;
  event: { kind: string; value: string; delta: string; order: string | null; horizon: number | null;
    source_value: string | null };
  steps: StepJson[];
  expect: { release_steps: number[]; withheld_from: number | null; guarantee: string; accountant: string;
    delta: string; event: string; epsilon_spent: string | null; steered_steps: number };
}

export interface MaskingJson {
  pieces: string[];
  private_context: string;
  cases: { spans: string[]; ids: number[] }[];
  errors: { spans: string[]; error: string }[];
}

export interface VectorsJson {
  format: string;
  cases: CaseJson[];
  masking: MaskingJson[];
  /** eps(n) of n pure eps-DP releases at a delta > 0 (float64 hex), as the Python ledger composes them */
  pure_dp_at_delta: { epsilon: string; delta: string; epsilons: [number, string][] }[];
}

export function loadVectors(): VectorsJson {
  return JSON.parse(readFileSync(VECTORS_PATH, "utf-8")) as VectorsJson;
}

/** A float32 array from the hex of its little-endian bytes. */
export function f32FromHex(hex: string): Float32Array {
  const bytes = Buffer.from(hex, "hex");
  const out = new Float32Array(bytes.length / 4);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  for (let i = 0; i < out.length; i++) out[i] = view.getFloat32(4 * i, true);
  return out;
}

/** A float32 array as the hex of its little-endian bytes. */
export function f32ToHex(values: ArrayLike<number>): string {
  const view = new DataView(new ArrayBuffer(4 * values.length));
  for (let i = 0; i < values.length; i++) view.setFloat32(4 * i, values[i], true);
  return Buffer.from(view.buffer).toString("hex");
}

/** A float64 from the hex of its big-endian bytes. */
export function f64FromHex(hex: string): number {
  return Buffer.from(hex, "hex").readDoubleBE(0);
}

/** A float64 as the hex of its big-endian bytes. */
export function f64ToHex(value: number): string {
  const buffer = Buffer.alloc(8);
  buffer.writeDoubleBE(value, 0);
  return buffer.toString("hex");
}

/**
 * The draws Python's policy took, handed back in the same order: each call must ask for the kind (and count) of
 * draw that was recorded next, and {@link ReplayDraws.finished} says whether every draw was taken.
 */
export class ReplayDraws implements Draws {
  private next = 0;

  constructor(private readonly draws: [string, string | string[]][]) {}

  random(): number {
    const [, value] = this.take("random");
    return f64FromHex(value as string);
  }

  randomRaw(n: number): BigUint64Array {
    const [, words] = this.take("raw");
    const list = words as string[];
    if (list.length !== n) throw new Error(`asked for ${n} raw words, Python drew ${list.length}`);
    return BigUint64Array.from(list, (word) => BigInt(`0x${word}`));
  }

  get finished(): boolean {
    return this.next === this.draws.length;
  }

  private take(kind: string): [string, string | string[]] {
    const draw = this.draws[this.next];
    if (draw === undefined) throw new Error(`asked for a ${kind} draw, Python drew no more`);
    if (draw[0] !== kind) throw new Error(`asked for a ${kind} draw, Python drew ${draw[0]}`);
    this.next += 1;
    return draw;
  }
}
