/**
 * The parts of one decoding step the loop owns, one object per concern (Python: `edge_sdk.steps`; the loop in
 * `decoder.ts` strings them): the pending signal, the pacer, the stop control and the step's meter with the ledger
 * entry it ends in.  The decide step itself (the SLM's view, the exposure budget, the accountant) is the core's
 * `StepDecider`.
 */

import type { SLMBackend } from "../backends/base.js";
import type { StepDecision } from "../core/decide.js";
import { CloudUpload } from "../policies/base.js";
import type { LedgerEntry } from "../privacy/ledger.js";
import type { ByteCounter } from "./connection.js";

/** A step from its first attempt until the cloud acknowledges its signal: decided once, re-sent byte for byte. */
export class PendingSignal {
  decision: StepDecision | null = null;
  fullRequests = 0;
  sends = 0;
  bytesUp = 0; // what earlier, broken attempts carried
  bytesDown = 0;

  constructor(readonly step: number, readonly withheld: boolean, readonly noStop = false) {}

  keepBytes(meter: StepMeter): void {
    this.bytesUp += meter.bytesUp;
    this.bytesDown += meter.bytesDown;
  }
}

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));
const now = () => performance.now();

/** Resolves at `target` on `performance.now()`'s clock, never before: a timer counts from the event loop's cached
 * time, which may lag the clock by a millisecond or more, so it can fire early; what is left is waited again. */
async function sleepUntil(target: number): Promise<void> {
  for (let left = target - now(); left > 0; left = target - now()) await sleep(left);
}

/**
 * Paced signals: step t's leaves at the first point of `S + n * pace` (n >= 1) at or after it is ready, `S` the
 * previous signal's slot; the open at the first point of `B + n * prefillBudget` after the prefill (Python:
 * `edge_sdk.steps.Pacer`; times in ms on `performance.now()`'s clock).
 */
export class Pacer {
  paceMs: number | null;
  lastSlot = 0;
  private beganAtMs: number | null = null;
  private notBeforeMs = -Infinity;

  constructor(
    private readonly fixedPaceMs: number | null,
    readonly prefillBudgetMs: number | null = null,
    private readonly autoPaceMs: number | null = null,
  ) {
    this.paceMs = fixedPaceMs;
  }

  get beganAt(): number | null {
    return this.beganAtMs === null ? null : Math.max(this.beganAtMs, this.notBeforeMs);
  }

  begin(at: number): void {
    this.beganAtMs = this.beganAtMs === null ? at : Math.min(this.beganAtMs, at);
  }

  notBefore(at: number): void {
    this.notBeforeMs = Math.max(this.notBeforeMs, at);
  }

  /** Sleep until the open's slot; whether the prefill ran past its first one. */
  async waitForOpen(): Promise<boolean> {
    if (this.prefillBudgetMs === null || this.beganAt === null) return false;
    return (await Pacer.waitOnGrid(this.beganAt, this.prefillBudgetMs)) > 1;
  }

  start(auto = false): void {
    this.paceMs = this.fixedPaceMs !== null || !auto ? this.fixedPaceMs : this.autoPaceMs;
    this.lastSlot = now();
  }

  restart(at: number): void {
    this.lastSlot = Math.max(this.lastSlot, at);
  }

  /** Sleep until this step's slot; whether the signal missed its first one. */
  async waitForSlot(): Promise<boolean> {
    if (this.paceMs === null) return false;
    const slots = await Pacer.waitOnGrid(this.lastSlot, this.paceMs);
    this.lastSlot += slots * this.paceMs;
    return slots > 1;
  }

  private static async waitOnGrid(origin: number, period: number): Promise<number> {
    const slots = Math.max(1, Math.ceil((now() - origin) / period));
    await sleepUntil(origin + slots * period);
    return slots;
  }
}

/** When a generation may end and when it is complete, read off the text generated so far (public to both sides). */
export interface StoppingRule {
  allowsEnd(text: string): boolean;
  isDone(text: string): boolean;
}

/** The end-of-generation ids (the SLM's joined by the cloud's at each open) and the optional rule. */
export class StopControl {
  ids: ReadonlySet<number>;
  private text: [number, string] | null = null;

  constructor(readonly slm: SLMBackend, readonly rule: StoppingRule | null) {
    this.ids = new Set(slm.eosTokenIds);
  }

  open(cloudEosIds: ReadonlySet<number>): void {
    this.ids = new Set([...this.slm.eosTokenIds, ...cloudEosIds]);
  }

  /** The stop ids within the vocabulary, ascending. */
  idArray(): Int32Array {
    return Int32Array.from([...this.ids].filter((id) => id < this.slm.vocabSize).sort((a, b) => a - b));
  }

  private async textOf(tokens: readonly number[]): Promise<string> {
    if (this.text === null || this.text[0] !== tokens.length) this.text = [tokens.length, await this.slm.detokenize(tokens)];
    return this.text[1];
  }

  async allowsEnd(tokens: readonly number[]): Promise<boolean> {
    return this.rule === null || this.rule.allowsEnd(await this.textOf(tokens));
  }

  async isDone(tokens: readonly number[]): Promise<boolean> {
    return this.rule !== null && this.rule.isDone(await this.textOf(tokens));
  }
}

/** One step's timings and bytes (from when it was created), and the ledger entry they end in. */
export class StepMeter {
  waitMs = 0;
  edgeMs = 0;
  cloudForwardNs = 0;
  private readonly up0: number;
  private readonly down0: number;

  constructor(private readonly counter: ByteCounter) {
    this.up0 = counter.edgeToCloud;
    this.down0 = counter.cloudToEdge;
  }

  get bytesUp(): number {
    return this.counter.edgeToCloud - this.up0;
  }

  get bytesDown(): number {
    return this.counter.cloudToEdge - this.down0;
  }

  /** Time blocked on the cloud. */
  waiting<T>(work: () => Promise<T>): Promise<T> {
    return this.timed(work, (ms) => (this.waitMs += ms));
  }

  /** The edge's own time. */
  onEdge<T>(work: () => Promise<T>): Promise<T> {
    return this.timed(work, (ms) => (this.edgeMs += ms));
  }

  /** A wait for a pacing slot inside {@link onEdge}: not the edge's own time. */
  pacing<T>(work: () => Promise<T>): Promise<T> {
    return this.timed(work, (ms) => (this.edgeMs -= ms));
  }

  private async timed<T>(work: () => Promise<T>, add: (ms: number) => void): Promise<T> {
    const started = now();
    try {
      return await work();
    } finally {
      add(now() - started);
    }
  }

  entry(pending: PendingSignal, tokenId: number, o: { policy: string; steered: boolean; leakShare: number; paceOverrun: boolean }): LedgerEntry {
    const decision = pending.decision;
    if (decision === null) throw new Error("a step is recorded once its signal was sent");
    const signal = decision.signal;
    const upload = signal instanceof CloudUpload;
    return {
      step: pending.step,
      token_id: tokenId,
      policy: o.policy,
      signal: upload ? "upload" : "token",
      values_uploaded: upload ? signal.length : 0,
      full_requested: pending.fullRequests > 0,
      withheld: pending.withheld,
      steered: o.steered,
      bytes_up: pending.bytesUp + this.bytesUp,
      bytes_down: pending.bytesDown + this.bytesDown,
      leak_share: o.leakShare,
      edge_ms: this.edgeMs,
      wait_ms: this.waitMs,
      cloud_forward_ms: this.cloudForwardNs / 1e6,
      exposure: [...decision.exposure],
      sends: pending.sends,
      full_requests: pending.fullRequests,
      pace_overrun: o.paceOverrun,
    };
  }
}
