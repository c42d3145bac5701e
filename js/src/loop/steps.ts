/**
 * The parts of one decoding step, one object per concern (Python: `edge_sdk.steps`; the loop in `decoder.ts`
 * strings them): the SLM's view, the exposure budget, the pending signal, the pacer, the stop control and the
 * step's meter with the ledger entry it ends in.
 */

import type { SLMBackend } from "../backends/base.js";
import { FLOAT32_LOWEST, type CloudDistribution, type FusionSpace, type Signal } from "../wire/index.js";
import type { ByteCounter } from "./connection.js";

/** `p(i) = exp(z(i) - max z) / sum_j exp(z(j) - max z)`, stored in float32. */
export function softmax(logits: Float32Array): Float32Array {
  let top = -Infinity;
  for (const z of logits) if (z > top) top = z;
  const p = new Float32Array(logits.length);
  let total = 0;
  for (let i = 0; i < p.length; i++) {
    p[i] = Math.exp(logits[i] - top);
    total += p[i];
  }
  const scale = Math.fround(total);
  for (let i = 0; i < p.length; i++) p[i] /= scale;
  return p;
}

/** The SLM's row for the next step in the policy's space, with what it says of masked ids removed. */
export class SLMView {
  readonly lowest: number;
  row: Float32Array | null = null;
  private readonly masked: Int32Array;

  constructor(readonly slm: SLMBackend, readonly space: FusionSpace, maskedIds: Iterable<number>) {
    this.masked = Int32Array.from([...new Set(maskedIds)].sort((a, b) => a - b));
    this.lowest = space === "logit" ? FLOAT32_LOWEST : 0;
  }

  get maskedCount(): number {
    return this.masked.length;
  }

  async prefill(ids: readonly number[]): Promise<void> {
    this.row = this.arrays(await this.slm.prefill(ids));
  }

  async advance(tokenId: number): Promise<void> {
    this.row = this.arrays(await this.slm.append(tokenId));
  }

  /**
   * The SLM's row as the policy reads it: probability space `softmax(z)` (or the backend's probabilities) with
   * masked ids zeroed and the rest renormalised; logit space the raw logits with masked ids at float32's lowest value.
   */
  arrays(row: Float32Array): Float32Array {
    const z = row.subarray(0, this.slm.vocabSize);
    for (let i = 0; i < z.length; i++) {
      if (!Number.isFinite(z[i])) {
        throw new RangeError(`the SLM's ${this.slm.rowKind} hold a non-finite value (first at id ${i}: ${z[i]}); ` +
          "refusing to rank or fuse it");
      }
    }
    if (this.space === "logit") {
      const logits = z.slice();
      for (const id of this.masked) logits[id] = this.lowest;
      return logits;
    }
    const p = this.slm.rowKind === "logits" ? softmax(z) : z.slice();
    if (this.masked.length) {
      for (const id of this.masked) p[id] = 0;
      let total = 0;
      for (const v of p) total += v;
      if (total > 0) {
        const scale = Math.fround(total);
        for (let i = 0; i < p.length; i++) p[i] /= scale;
      }
    }
    return p;
  }
}

/** Whether the private context steered this step's signal, as the cloud itself can tell (an upload holds anything;
 * a token is not the cloud's own top token). */
export function isSteered(signal: Signal, dist: CloudDistribution): boolean {
  return signal.kind === "upload" ? signal.ids.length > 0 : signal.tokenId !== dist.topId();
}

/** The epsilon account the budget reads (Python: `edge_sdk.accountant.PrivacyAccountant`'s part the loop uses). */
export interface Accountant {
  /** Whether `step` must send only a cloud-only signal because the budget is spent (public numbers only). */
  withholds(step: number): boolean;
  /** Record a signal decided from the private context. */
  record(step: number, steered: boolean): void;
  readonly releaseSteps: readonly number[];
}

/** The account of a policy with no DP guarantee and no epsilon budget: a release is a steered step. */
export class HeuristicAccountant implements Accountant {
  readonly releaseSteps: number[] = [];

  withholds(): boolean {
    return false;
  }

  record(step: number, steered: boolean): void {
    if (steered) this.releaseSteps.push(step);
  }
}

/** When a step may send only a signal the cloud could produce alone: at most `floor(share * maxSteps)` steered
 * steps, and the accountant's budget; both read public numbers and counts the cloud keeps itself. */
export class ExposureBudget {
  steeredSteps = 0;

  constructor(readonly share: number | null, readonly accountant: Accountant) {}

  withholds(step: number, maxSteps: number): boolean {
    const overShare = this.share !== null && this.steeredSteps + 1 > this.share * maxSteps;
    return this.accountant.withholds(step) || overShare;
  }

  recordRelease(step: number, signal: Signal, dist: CloudDistribution): void {
    this.accountant.record(step, isSteered(signal, dist));
  }

  countSteered(signal: Signal, dist: CloudDistribution): boolean {
    const steered = isSteered(signal, dist);
    if (steered) this.steeredSteps++;
    return steered;
  }
}

/** What the decide step settled: `signal` leaves the device; `exposure` is DecodeLeak's `E_t^K`. */
export interface StepDecision {
  readonly signal: Signal;
  readonly exposure: Int32Array;
}

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
    const delay = origin + slots * period - now();
    if (delay > 0) await sleep(delay);
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

/** What left the device at one step, and why (Python: `edge_sdk.ledger.LedgerEntry`). */
export interface LedgerEntry {
  step: number;
  tokenId: number;
  policy: string;
  signal: "upload" | "token";
  valuesUploaded: number;
  fullRequested: boolean;
  withheld: boolean;
  steered: boolean;
  bytesUp: number;
  bytesDown: number;
  leakShare: number;
  edgeMs: number;
  waitMs: number;
  cloudForwardMs: number;
  exposure: number[];
  sends: number;
  fullRequests: number;
  paceOverrun: boolean;
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
    return {
      step: pending.step,
      tokenId,
      policy: o.policy,
      signal: signal.kind,
      valuesUploaded: signal.kind === "upload" ? signal.ids.length : 0,
      fullRequested: pending.fullRequests > 0,
      withheld: pending.withheld,
      steered: o.steered,
      bytesUp: pending.bytesUp + this.bytesUp,
      bytesDown: pending.bytesDown + this.bytesDown,
      leakShare: o.leakShare,
      edgeMs: this.edgeMs,
      waitMs: this.waitMs,
      cloudForwardMs: this.cloudForwardNs / 1e6,
      exposure: Array.from(decision.exposure),
      sends: pending.sends,
      fullRequests: pending.fullRequests,
      paceOverrun: o.paceOverrun,
    };
  }
}

/** What share of the private context's content tokens the cloud has observed so far (Python: `LeakageMeter`). */
export class LeakageMeter {
  readonly exposed = new Set<number>();

  constructor(readonly privateContentIds: ReadonlySet<number>) {}

  observe(ids: Iterable<number>): void {
    for (const id of ids) this.exposed.add(id);
  }

  get share(): number {
    if (!this.privateContentIds.size) return 0;
    let leaked = 0;
    for (const id of this.privateContentIds) if (this.exposed.has(id)) leaked++;
    return leaked / this.privateContentIds.size;
  }
}

/** Per-step record of everything that left the device in one generation (Python: `PrivacyLedger`). */
export class PrivacyLedger {
  readonly entries: LedgerEntry[] = [];
  reconnects = 0;
  prefillOverrun = false;
  readonly sessionIds: string[] = [];
  cloudModel: string | null = null;

  constructor(readonly mode: string, readonly policy: string, readonly exposureK: number, readonly accountant: Accountant) {}

  get bytesUp(): number {
    return this.entries.reduce((sum, e) => sum + e.bytesUp, 0);
  }

  get bytesDown(): number {
    return this.entries.reduce((sum, e) => sum + e.bytesDown, 0);
  }
}
