/**
 * The collaborative decoding loop, written once for every carrier (Python: `edge_sdk.decoding`).
 *
 * A step is four named parts: receive the cloud's row, decide the signal (through the policy), send it, record
 * and advance.  The SLM runs its next step after the send, while the cloud computes its own.
 */

import type { SLMBackend } from "../backends/base.js";
import { StepDecider, type StepDecision } from "../core/decide.js";
import { CloudError, NotImplementedInTypeScriptError } from "../core/errors.js";
import { checkFinite, osDraws, type Draws } from "../core/fusion.js";
import { tokenLogprobs } from "../core/logprobs.js";
import { CloudUpload, type Policy } from "../policies/base.js";
import { LeakageMeter, type LedgerEntry, type PrivacyLedger } from "../privacy/ledger.js";
import { FULL_UPLOAD_LIMIT, maskProbabilities } from "../privacy/masking.js";
import type { ReceivedDistribution, SessionRequest, TokenLogprobs } from "../wire/index.js";
import type { CloudConnection } from "./connection.js";
import { decodeSettings, type DecodeSettings } from "./settings.js";
import { Pacer, PendingSignal, StepMeter, StopControl, type StoppingRule } from "./steps.js";

/** One decided token as the loop yields it. */
export interface StepEvent {
  tokenId: number;
  entry: LedgerEntry;
  logprobs: TokenLogprobs | null;
}

export interface DecoderOptions {
  /** ids the SLM conditions on (private context + public query) */
  slmPrompt: readonly number[];
  /** ids the cloud conditions on (public query only) */
  cloudPrompt: readonly number[];
  /** the private context's content ids, for the leakage meter */
  privateContentIds?: ReadonlySet<number>;
  /** ids of `never_upload` spans: the SLM's values for them are removed before the policy runs */
  maskedIds?: Iterable<number>;
  /** the draws randomised policies consume (default: the OS's entropy, never anything on the wire) */
  draws?: Draws;
  stopping?: StoppingRule | null;
}

/** Runs one generation: holds the shared prefix and can resume on a new connection. */
export class CollaborativeDecoder {
  readonly policy: Policy;
  readonly settings: DecodeSettings;
  /** the decide step: the SLM's view, the policy, the budgets and the ledger (the core's) */
  readonly decider: StepDecider;
  readonly pacer: Pacer;
  readonly stop: StopControl;
  readonly meter: LeakageMeter;
  readonly tokens: number[] = [];
  finishReason: string | null = null;
  /** the SLM's row for the next step as the policy reads it */
  private row: Float32Array | null = null;
  private readonly slmPrompt: number[];
  private readonly cloudPrompt: number[];
  private pending: PendingSignal | null = null;
  private unacknowledged: PendingSignal[] = [];

  constructor(readonly slm: SLMBackend, policy: Policy, settings: Partial<DecodeSettings>, options: DecoderOptions) {
    const s = decodeSettings(settings);
    if (policy.space === "logit" && slm.rowKind !== "logits") {
      throw new NotImplementedInTypeScriptError(`policy '${policy.name}' fuses raw logits; the SLM backend ` +
        `'${slm.name}' gives probabilities only`);
    }
    this.decider = new StepDecider(policy, s, slm.vocabSize, options.maskedIds ?? [], options.draws ?? osDraws);
    this.policy = this.decider.policy;
    this.settings = s;
    this.slmPrompt = [...options.slmPrompt];
    this.cloudPrompt = [...options.cloudPrompt];
    this.pacer = new Pacer(s.paceMs, s.prefillBudgetMs, s.autoPaceMs);
    this.stop = new StopControl(slm, options.stopping ?? null);
    this.meter = new LeakageMeter(options.privateContentIds ?? new Set());
  }

  get ledger(): PrivacyLedger {
    return this.decider.ledger;
  }

  /** The SLM's row as the policy reads it (`never_upload` ids removed): probabilities from a backend that gives
   * them are masked as they are (the softmax of their logs would only round them again), in place: the row is the
   * decoder's (`SLMBackend.prefill`/`append` hand out a fresh array), so it is not copied. */
  private view(row: Float32Array): Float32Array {
    if (this.slm.rowKind === "logits") return this.decider.view(row);
    const p = checkFinite(row.subarray(0, this.slm.vocabSize), "the SLM's probabilities");
    return maskProbabilities(p, this.decider.masked); // probability space: a logit policy is refused without logits
  }

  /** How many cloud values to ask for per sparse step (edge-side at least K: the exposure set is the cloud's top K). */
  get topM(): number {
    const s = this.settings;
    return Math.min(s.mode === "edge" ? Math.max(s.topM, s.exposureK) : s.topM, this.slm.vocabSize);
  }

  /** The most values a step's upload may hold, from public settings only. */
  get maxUpload(): number {
    const vocabSize = this.slm.vocabSize;
    const most = this.policy.maxUpload(vocabSize);
    if (most >= vocabSize && this.policy.space === "prob") return Math.min(FULL_UPLOAD_LIMIT, vocabSize);
    return most;
  }

  async request(): Promise<SessionRequest> {
    const s = this.settings;
    return {
      promptIds: this.cloudPrompt,
      mode: s.mode,
      alpha: s.alpha,
      space: this.policy.space,
      temperature: s.temperature,
      seed: s.mode === "cloud" ? s.seed : 0n,
      maxNewTokens: s.maxNewTokens,
      vocabFingerprint: await this.slm.vocabFingerprint(),
      edgeModel: this.slm.name,
      vocabSize: this.slm.vocabSize,
      topM: this.topM,
      resumePrefix: this.acknowledgedTokens(),
      stopTokenIds: [...this.slm.eosTokenIds].sort((a, b) => a - b),
      logprobs: s.mode === "cloud" && s.logprobs !== null,
      topLogprobs: s.mode === "cloud" ? s.logprobs ?? 0 : 0,
      jsonSchema: "",
      lookahead: 0,
      padded: false,
    };
  }

  private acknowledgedTokens(): number[] {
    return this.tokens.slice(0, this.unacknowledged.length ? this.unacknowledged[0].step : this.tokens.length);
  }

  // -- the loop ---------------------------------------------------------------------------------------------

  /** Open (or resume) the session on `connection` and decode until the end. */
  async *steps(connection: CloudConnection): AsyncGenerator<StepEvent> {
    if (this.row === null) {
      this.pacer.begin(performance.now());
      // a defence: the SLM prefills the private prompt before the session opens
      this.row = this.view(await this.slm.prefill([...this.slmPrompt, ...this.tokens]));
      this.ledger.prefillOverrun = await this.pacer.waitForOpen();
    }
    const maxSteps = await this.open(connection);
    try {
      await this.replayUnacknowledged(connection, maxSteps);
      if (this.finishReason === "stop_rule") {
        await this.finish(connection, this.tokens[this.tokens.length - 1]);
        return;
      }
      yield* this.decode(connection, maxSteps);
    } catch (error) {
      if (error instanceof CloudError) this.forgetAcknowledged(connection);
      throw error;
    }
  }

  private async *decode(connection: CloudConnection, maxSteps: number): AsyncGenerator<StepEvent> {
    while (this.tokens.length < maxSteps) {
      const step = this.tokens.length;
      const meter = new StepMeter(connection.bytes);
      let dist = await this.receive(connection, step, meter);
      const [noStop, pending] = await meter.onEdge(async () => {
        const noStop = !(await this.stop.allowsEnd(this.tokens));
        return [noStop, this.pendingSignal(step, maxSteps, noStop)] as const;
      });
      let token: number;
      let finished: boolean;
      let overrun: boolean;
      try {
        let requestOverrun: boolean;
        [dist, requestOverrun] = await meter.onEdge(() => this.decide(connection, pending, dist, noStop, meter));
        overrun = (await this.pacer.waitForSlot()) || requestOverrun; // a defence: paced, the send time is public
        [token, finished] = await this.send(connection, pending, noStop, maxSteps, meter);
      } catch (error) {
        if (error instanceof CloudError) pending.keepBytes(meter);
        throw error;
      }
      this.pending = null;
      if (this.settings.mode === "cloud") {
        this.unacknowledged.push(pending);
        this.forgetAcknowledged(connection);
      }
      const logprobs = this.logprobs(connection, pending.decision!); // after the send: never delays a signal
      const steered = this.record(pending, dist, token);
      finished = await this.advance(token, finished, meter);
      const entry = meter.entry(pending, token, { policy: this.policy.name, steered, leakShare: this.meter.share,
        paceOverrun: overrun });
      this.ledger.entries.push(entry);
      yield { tokenId: token, entry, logprobs };
      if (finished) {
        await this.finish(connection, token);
        return;
      }
    }
    this.finishReason = "max_new_tokens";
  }

  /** The step's token's log-probabilities when the settings ask for them: cloud-side those the cloud sent with it,
   * edge-side read off the fused row the token was chosen from (`tokenLogprobs`). */
  private logprobs(connection: CloudConnection, decision: StepDecision): TokenLogprobs | null {
    const topN = this.settings.logprobs;
    if (topN === null) return null;
    const signal = decision.signal;
    if (signal instanceof CloudUpload) return connection.chosenLogprobs;
    return tokenLogprobs(decision.fused(), this.policy.space, signal.tokenId, topN);
  }

  // -- the loop's steps, in its order ------------------------------------------------------------------------

  /** Open the session; the number of steps it may run (the edge's and the cloud's limit). */
  private async open(connection: CloudConnection): Promise<number> {
    const info = await connection.open(await this.request(), this.maxUpload, this.settings.lookahead ?? connection.lookahead);
    // a defence: over a network a session that runs ahead, or fuses cloud-side, is paced (autoPaceMs)
    this.pacer.start(connection.crossesNetwork && (connection.runAhead || this.settings.mode === "cloud"));
    this.ledger.sessionIds.push(info.sessionId);
    this.ledger.cloudModel = info.cloudModel;
    if (info.vocabSize !== this.slm.vocabSize) {
      throw new CloudError("FAILED_PRECONDITION", `the cloud model '${info.cloudModel}' reports a vocabulary of ` +
        `${info.vocabSize} tokens, the edge model '${this.slm.name}' has ${this.slm.vocabSize}`);
    }
    this.stop.open(info.eosTokenIds);
    return Math.min(this.settings.maxNewTokens, info.maxNewTokens);
  }

  private async receive(connection: CloudConnection, step: number, meter: StepMeter): Promise<ReceivedDistribution> {
    const dist = await meter.waiting(() => connection.distribution());
    if (dist.step !== step) throw new CloudError("INTERNAL", `the cloud sent step ${dist.step}, expected ${step}`);
    meter.cloudForwardNs = dist.forwardNs;
    return dist;
  }

  /** `step`'s signal as begun on an earlier connection (re-sent byte for byte), or a new one the budget may withhold. */
  private pendingSignal(step: number, maxSteps: number, noStop: boolean): PendingSignal {
    if (this.pending === null || this.pending.step !== step) {
      this.pending = new PendingSignal(step, this.decider.withholds(step, maxSteps), noStop);
    }
    return this.pending;
  }

  /** Re-send the steps the cloud never acknowledged (cloud-side run-ahead picks read off certificates), each on its
   * row, byte for byte; the cloud's pick must be the token already yielded (else `DATA_LOSS`). */
  private async replayUnacknowledged(connection: CloudConnection, maxSteps: number): Promise<void> {
    for (const pending of [...this.unacknowledged]) {
      const meter = new StepMeter(connection.bytes);
      let token: number;
      let finished: boolean;
      try {
        await this.receive(connection, pending.step, meter);
        await this.pacer.waitForSlot();
        [token, finished] = await this.send(connection, pending, pending.noStop, maxSteps, meter);
      } finally {
        this.recordResend(pending, meter);
      }
      const yielded = this.tokens[pending.step];
      if (token !== yielded || finished) {
        throw new CloudError("DATA_LOSS", `resumed, the cloud chose token ${token} at step ${pending.step}` +
          `${finished ? " and ended the generation" : ""} where its row and the upload had certified ${yielded}, already yielded`);
      }
    }
  }

  private recordResend(pending: PendingSignal, meter: StepMeter): void {
    const entry = this.ledger.entries[pending.step];
    this.ledger.entries[pending.step] = { ...entry, sends: pending.sends, bytes_up: entry.bytes_up + meter.bytesUp,
      bytes_down: entry.bytes_down + meter.bytesDown };
  }

  private forgetAcknowledged(connection: CloudConnection): void {
    this.unacknowledged = this.unacknowledged.filter((p) => p.step >= connection.stepsAcknowledged);
  }

  /** Decide `pending`'s signal unless it was already (a resend); the row it was decided on, and whether a paced
   * full-row request missed its first slot.  A policy that reads full rows asks at every step. */
  private async decide(connection: CloudConnection, pending: PendingSignal, dist: ReceivedDistribution, noStop: boolean,
    meter: StepMeter): Promise<[ReceivedDistribution, boolean]> {
    if (pending.decision !== null) return [dist, false];
    let decision = this.decision(dist, pending.withheld, noStop);
    let overrun = false;
    if (decision === null) {
      pending.fullRequests++;
      overrun = await meter.pacing(() => this.pacer.waitForSlot());
      dist = await meter.waiting(() => connection.requestFull(pending.step));
      decision = this.decision(dist, pending.withheld, noStop);
      if (decision === null) {
        throw new CloudError("DATA_LOSS", `the cloud answered step ${pending.step}'s full-row request with a sparse row`);
      }
    }
    pending.decision = decision;
    if (!pending.withheld) this.decider.recordRelease(pending.step, decision.signal, dist);
    return [dist, overrun];
  }

  /** Send the step's signal (the same bytes on every attempt): the token, and whether the generation ended. */
  private async send(connection: CloudConnection, pending: PendingSignal, noStop: boolean, maxSteps: number,
    meter: StepMeter): Promise<[number, boolean]> {
    const signal = pending.decision!.signal;
    const step = pending.step;
    pending.sends++;
    if (signal instanceof CloudUpload) {
      const certified = connection.picksCertified;
      const picked = await meter.waiting(() => connection.upload(step, signal, noStop));
      if (connection.picksCertified === certified) this.pacer.restart(performance.now());
      return picked;
    }
    await connection.syncToken(step, signal.tokenId);
    return [signal.tokenId, this.stop.ids.has(signal.tokenId) || step + 1 >= maxSteps];
  }

  private record(pending: PendingSignal, dist: ReceivedDistribution, token: number): boolean {
    const decision = pending.decision!;
    this.meter.observe(decision.exposure);
    if (!(decision.signal instanceof CloudUpload)) this.meter.observe([token]);
    return this.decider.countSteered(decision.signal, dist);
  }

  /** Append `token`; whether the generation has ended (the SLM's next step runs after the send). */
  private async advance(token: number, finished: boolean, meter: StepMeter): Promise<boolean> {
    this.tokens.push(token);
    if (!finished && (await this.stop.isDone(this.tokens))) {
      finished = true;
      this.finishReason = "stop_rule";
    }
    if (!finished) await meter.onEdge(async () => void (this.row = this.view(await this.slm.append(token))));
    return finished;
  }

  private async finish(connection: CloudConnection, token: number): Promise<void> {
    if (this.finishReason === "stop_rule") {
      await connection.confirmPicks();
      this.forgetAcknowledged(connection);
      return;
    }
    try {
      this.finishReason = await connection.finished();
    } catch (error) {
      if (!(error instanceof CloudError)) throw error;
      this.finishReason = this.stop.ids.has(token) ? "eos" : "max_new_tokens"; // broke after the last token
    }
  }

  // -- the decide step ----------------------------------------------------------------------------------------

  /** The step's decision (the core's decide step), or `null` when the policy reads the full row and `dist` is
   * sparse.  `noStop` edge-side: end ids are out of the choice this step (cloud-side the cloud is told). */
  private decision(dist: ReceivedDistribution, withheld: boolean, noStop: boolean): StepDecision | null {
    if (this.row === null) throw new Error("the SLM prefills before the first step");
    const stops = noStop && this.settings.mode === "edge" ? [...this.stop.idArray()] : null;
    return this.decider.decide(this.row, dist, withheld, stops);
  }
}

/**
 * Drive `decoder` over connections from `connect`, reopening after a retryable failure: a reopened session replays
 * only public data (the public prompt, the acknowledged tokens, then the unacknowledged signals byte for byte).
 * The connection is closed however the loop ends.
 */
export async function* runWithResume(
  decoder: CollaborativeDecoder,
  connect: () => CloudConnection,
  { maxReconnects = 3, backoffMs = 500 }: { maxReconnects?: number; backoffMs?: number } = {},
): AsyncGenerator<StepEvent> {
  let attempts = 0;
  for (;;) {
    let connection: CloudConnection | null = null;
    try {
      connection = connect();
      yield* decoder.steps(connection);
      return;
    } catch (error) {
      if (!(error instanceof CloudError) || !error.retryable || attempts >= maxReconnects) throw error;
      attempts++;
      decoder.ledger.reconnects++;
      await new Promise((resolve) => setTimeout(resolve, backoffMs * attempts));
    } finally {
      if (connection !== null) await connection.close();
    }
  }
}

