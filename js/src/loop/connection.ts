/**
 * The edge's view of one cloud session, independent of the carrier (Python: `edge_sdk.protocol.connection.CloudConnection`):
 * every call maps to one protocol message, in the protocol's order (open, then per step the distribution, maybe a
 * full-row request, then the upload or the token), and the bytes each direction carries are counted.
 */

import { fromBinary, toBinary } from "@bufbuild/protobuf";
import type { MessageChannel } from "../carriers/channel.js";
import { CloudError, InvalidArgumentError } from "../core/errors.js";
import {
  CloudMessageSchema,
  EdgeMessageSchema,
  SignalSizes,
  decodeDistribution,
  decodeOpened,
  decodeTokenLogprobs,
  encodeClose,
  encodeOpen,
  encodeRequestFull,
  encodeToken,
  encodeUpload,
  padEdgeMessage,
  type CloudMessage,
  type Distribution,
  type EdgeMessage,
  type Finished,
  type SessionInfo,
  type SessionOpened,
  type SessionRequest,
  type TokenChosen,
  type ReceivedDistribution,
  type TokenLogprobs,
} from "../wire/index.js";
import type { CloudUpload } from "../policies/base.js";
import { certifiedFusedArgmax } from "./certify.js";

/** Serialised protobuf bytes each direction (what a network carries, before framing). */
export interface ByteCounter {
  edgeToCloud: number;
  cloudToEdge: number;
}

type Kind = CloudMessage["kind"]["case"];
interface Awaited {
  opened: SessionOpened;
  distribution: Distribution;
  token: TokenChosen;
  finished: Finished;
}

export class CloudConnection {
  readonly bytes: ByteCounter = { edgeToCloud: 0, cloudToEdge: 0 };
  info: SessionInfo | null = null;
  finishReason: string | null = null;
  /** how many steps the cloud has acknowledged (cloud-side: the resume prefix, then each step whose pick was read) */
  stepsAcknowledged = 0;
  /** drafted rows that assumed another token than the one confirmed */
  rowsDropped = 0;
  /** cloud-side steps whose pick the edge read off the certificate without waiting */
  picksCertified = 0;
  /** cloud-side fusion with logprobs asked for: those the cloud sent with the last token it picked */
  chosenLogprobs: TokenLogprobs | null = null;
  private request: SessionRequest | null = null;
  private sizes: SignalSizes | null = null;
  private readonly held: CloudMessage[] = [];
  private follows: [number, number] | null = null;
  private readonly unreadPicks: [number, number, boolean][] = [];
  private current: ReceivedDistribution | null = null;

  /** the run-ahead depth the open session asked for */
  private asked = 0;

  /**
   * @param lookahead the deepest run-ahead this edge accepts (sent when the session opens) unless the generation's
   *   settings say (`DecodeSettings.lookahead`, passed to {@link open}); 0 = lockstep
   * @param padded a defence: every step signal leaves padded to a size fixed by public settings, and the cloud is
   *   asked to pad its own
   */
  constructor(private readonly channel: MessageChannel, readonly lookahead = 0, readonly padded = true) {
    checkLookahead(lookahead);
  }

  get crossesNetwork(): boolean {
    return this.channel.crossesNetwork;
  }

  /** Whether the cloud agreed to run ahead in this session. */
  get runAhead(): boolean {
    return this.info !== null && this.info.lookahead > 0;
  }

  private async send(message: EdgeMessage): Promise<void> {
    let bytes: Uint8Array = toBinary(EdgeMessageSchema, message);
    if (this.padded && this.sizes !== null) bytes = padEdgeMessage(message, bytes, this.sizes);
    this.bytes.edgeToCloud += bytes.length;
    await this.channel.send(bytes);
  }

  private async read(): Promise<CloudMessage> {
    const bytes = await this.channel.receive();
    this.bytes.cloudToEdge += bytes.length;
    try {
      return fromBinary(CloudMessageSchema, bytes);
    } catch (error) {
      throw new CloudError("DATA_LOSS", `the cloud sent a message that does not parse: ${(error as Error).message}`);
    }
  }

  /** Keep a drafted row read ahead of the message awaited, within what an honest cloud can have sent by then. */
  private hold(message: CloudMessage): void {
    const info = this.requireInfo();
    const limit = info.lookahead + this.unreadPicks.length + 1;
    if (this.held.length >= limit) {
      throw new CloudError("RESOURCE_EXHAUSTED", `the cloud sent more than ${limit} rows ahead of the message the ` +
        "edge awaited");
    }
    this.held.push(message);
  }

  /** The next message that is not the pick of a step taken from a certificate (those are checked here). */
  private async nextMessage(): Promise<CloudMessage> {
    let message = await this.read();
    while (message.kind.case === "token" && this.unreadPicks.length) {
      this.checkPick(message.kind.value);
      message = await this.read();
    }
    return message;
  }

  private checkPick(chosen: TokenChosen): void {
    const [step, token, finished] = this.unreadPicks.shift()!;
    if (Number(chosen.step) !== step || chosen.tokenId !== token || chosen.finished !== finished) {
      throw new CloudError("DATA_LOSS", `the cloud chose token ${chosen.tokenId} at step ${chosen.step} where its row ` +
        `and the upload certify ${token} at step ${step}`);
    }
    this.stepsAcknowledged = step + 1;
  }

  private endedEarly(finished: Finished): CloudError {
    this.finishReason = finished.reason;
    return new CloudError("ABORTED", `the cloud finished the session early (${finished.reason})`);
  }

  /** Read and check the cloud's picks of every step whose token was taken from a certificate. */
  async confirmPicks(): Promise<void> {
    while (this.unreadPicks.length) {
      const message = await this.read();
      const kind = message.kind;
      if (kind.case === "token") this.checkPick(kind.value);
      else if (kind.case === "finished") throw this.endedEarly(kind.value);
      else if (kind.case !== "distribution") {
        throw new CloudError("INTERNAL", `protocol violation: expected token, the cloud sent ${kind.case}`);
      }
    }
  }

  /** The next message, which must be `expected`; `hold`: distributions read first are kept. */
  private async receive<K extends keyof Awaited>(expected: K, hold = false): Promise<Awaited[K]> {
    for (;;) {
      const message = expected === "distribution" && this.held.length ? this.held.shift()! : await this.nextMessage();
      const kind = message.kind;
      if (hold && kind.case === "distribution" && expected !== "distribution") {
        this.hold(message);
        continue;
      }
      if (kind.case === "finished" && expected !== "finished") throw this.endedEarly(kind.value);
      if (kind.case !== expected) {
        throw new CloudError("INTERNAL", `protocol violation: expected ${expected}, the cloud sent ${kindName(kind.case)}`);
      }
      return kind.value as Awaited[K];
    }
  }

  /** Open the session; `maxUpload`: the most values a step's upload may hold (a public number); `lookahead`: the
   * deepest run-ahead this session accepts (default: the connection's). */
  async open(request: SessionRequest, maxUpload?: number, lookahead: number = this.lookahead): Promise<SessionInfo> {
    this.asked = checkLookahead(lookahead);
    request = { ...request, lookahead, padded: this.padded };
    this.request = request;
    await this.send(encodeOpen(request));
    this.sizes = new SignalSizes(request.vocabSize, maxUpload ?? request.vocabSize);
    const info = decodeOpened(await this.receive("opened"));
    this.stepsAcknowledged = request.resumePrefix.length;
    if (info.lookahead > lookahead) {
      throw new CloudError("INTERNAL", `the cloud chose run-ahead depth ${info.lookahead}, more than the ` +
        `${lookahead} asked for`);
    }
    this.info = info;
    return info;
  }

  /** The cloud's row for the next step (run-ahead: the first that follows the token last confirmed). */
  async distribution(): Promise<ReceivedDistribution> {
    for (;;) {
      const dist = this.decodeDistribution(await this.receive("distribution"));
      if (this.follows === null || (dist.step === this.follows[0] && dist.assumesToken === this.follows[1])) {
        this.current = dist;
        return dist;
      }
      if (dist.step < this.follows[0] || dist.step > this.follows[0] + this.asked) {
        throw new CloudError("INTERNAL", `the cloud sent step ${dist.step}, expected ${this.follows[0]}`);
      }
      this.rowsDropped++;
    }
  }

  private decodeDistribution(message: Distribution): ReceivedDistribution {
    const info = this.requireInfo();
    const request = this.request!;
    let dist: ReceivedDistribution;
    try {
      dist = decodeDistribution(message, info.vocabSize);
    } catch (error) {
      throw new CloudError("DATA_LOSS", `the cloud sent a malformed distribution: ${(error as Error).message}`);
    }
    const values = dist.dense ?? dist.values;
    if (dist.dense === null && dist.ids.length < Math.min(request.topM, info.vocabSize)) {
      throw new CloudError("DATA_LOSS", `the cloud sent ${dist.ids.length} values, fewer than the ${request.topM} asked for`);
    }
    if (request.space === "prob" && values.length) {
      let total = 0;
      let low = Infinity;
      let high = -Infinity;
      for (const v of values) {
        total += v;
        low = Math.min(low, v);
        high = Math.max(high, v);
      }
      if (low < 0 || high > 1 || total > 1 + 1e-3 || (dist.dense !== null && total < 1 - 1e-3)) {
        throw new CloudError("DATA_LOSS", "the cloud sent probabilities that are not a distribution");
      }
    }
    return dist;
  }

  /** Ask for the full distribution of `step` (the cloud learns that we asked). */
  async requestFull(step: number): Promise<ReceivedDistribution> {
    this.requireInfo();
    await this.send(encodeRequestFull(step));
    const full = this.decodeDistribution(await this.receiveForStep(step));
    if (!full.isFull || full.step !== step) {
      throw new CloudError("DATA_LOSS", `the cloud answered the full-row request of step ${step} with a ` +
        `${full.isFull ? "full" : "sparse"} row of step ${full.step}`);
    }
    this.current = full;
    return full;
  }

  private async receiveForStep(step: number): Promise<Distribution> {
    for (;;) {
      const message = await this.nextMessage();
      const kind = message.kind;
      if (kind.case === "distribution" && Number(kind.value.step) > step) {
        this.hold(message);
        continue;
      }
      if (kind.case === "finished") throw this.endedEarly(kind.value);
      if (kind.case !== "distribution") {
        throw new CloudError("INTERNAL", `protocol violation: expected distribution, the cloud sent ${kindName(kind.case)}`);
      }
      return kind.value;
    }
  }

  /**
   * Cloud-side fusion: send the upload; the token the cloud picked and whether the generation finished.
   * Run-ahead: a pick the cloud's row and the upload certify is returned at once and checked when the cloud's
   * `TokenChosen` is read; until then the step is not acknowledged.
   */
  async upload(step: number, upload: CloudUpload, noStop = false): Promise<[number, boolean]> {
    const info = this.requireInfo();
    await this.send(encodeUpload(step, upload, info.vocabSize, noStop));
    const certain = this.runAhead ? this.certifiedPick(step, upload, noStop) : null;
    const finished = certain !== null && (info.eosTokenIds.has(certain) || step + 1 >= info.maxNewTokens);
    if (certain !== null && !finished) {
      this.unreadPicks.push([step, certain, finished]);
      this.follows = [step + 1, certain];
      this.picksCertified++;
      return [certain, finished];
    }
    const chosen = await this.receive("token", true);
    if (Number(chosen.step) !== step) throw new CloudError("INTERNAL", `the cloud answered step ${chosen.step} to step ${step}`);
    if (chosen.tokenId >= info.vocabSize) {
      throw new CloudError("DATA_LOSS", `the cloud chose token ${chosen.tokenId}, outside the vocabulary`);
    }
    this.stepsAcknowledged = step + 1;
    if (this.runAhead) this.follows = [step + 1, chosen.tokenId];
    this.chosenLogprobs = this.decodeChosenLogprobs(chosen);
    return [chosen.tokenId, chosen.finished];
  }

  private decodeChosenLogprobs(chosen: TokenChosen): TokenLogprobs | null {
    const info = this.requireInfo();
    const request = this.request!;
    let logprobs: TokenLogprobs | null;
    try {
      logprobs = decodeTokenLogprobs(chosen, info.vocabSize, request.topLogprobs);
    } catch (error) {
      throw new CloudError("DATA_LOSS", `the cloud sent malformed log-probabilities: ${(error as Error).message}`);
    }
    if ((logprobs !== null) !== request.logprobs) {
      throw new CloudError("DATA_LOSS", "the cloud's log-probabilities do not match what the session asked for");
    }
    return logprobs;
  }

  /** Cloud-side greedy fusion: the token the cloud picks with `upload` when this step's row certifies it. */
  private certifiedPick(step: number, upload: CloudUpload, noStop: boolean): number | null {
    const request = this.request!;
    const info = this.requireInfo();
    const dist = this.current;
    if (request.temperature !== 0 || request.logprobs || dist === null || dist.step !== step) return null;
    let alpha = request.alpha;
    if (alpha === 0 && !upload.ids.length) alpha = 1; // the cloud then picks from its own row
    const excluded: ReadonlySet<number> = noStop ? info.eosTokenIds : new Set();
    if (dist.dense !== null) {
      const everyId = Int32Array.from({ length: info.vocabSize }, (_, i) => i);
      return certifiedFusedArgmax(everyId, dist.dense, 0, upload.ids, upload.values, alpha, info.vocabSize, excluded);
    }
    return certifiedFusedArgmax(dist.ids, dist.values, dist.tailBound, upload.ids, upload.values, alpha, info.vocabSize,
      excluded);
  }

  /** Edge-side fusion: send the chosen token (the reply is the next distribution). */
  async syncToken(step: number, tokenId: number): Promise<void> {
    await this.send(encodeToken(step, tokenId));
    if (this.runAhead) this.follows = [step + 1, tokenId];
  }

  /** Read the cloud's end-of-session message (drafted rows before it are dropped); its reason. */
  async finished(): Promise<string> {
    this.held.length = 0;
    this.finishReason = (await this.receive("finished", true)).reason;
    this.held.length = 0;
    return this.finishReason;
  }

  /** Tell the cloud we are done (if the session is still open) and release the channel. */
  async close(): Promise<void> {
    try {
      if (this.info !== null && this.finishReason === null) {
        await this.send(encodeClose());
        this.held.length = 0;
        this.finishReason = (await this.receive("finished", true)).reason;
      }
    } catch (error) {
      if (!(error instanceof CloudError)) throw error; // the stream is already gone
    } finally {
      this.channel.close();
    }
  }

  private requireInfo(): SessionInfo {
    if (this.info === null) throw new Error("open the session first");
    return this.info;
  }
}

/** The oneof's case as Python's `WhichOneof` names it (`None` when unset). */
function kindName(kind: Kind): string {
  return kind ?? "None";
}

/** `lookahead` if it is a run-ahead depth (an integer >= 0), else `InvalidArgumentError` (Python's message). */
function checkLookahead(lookahead: number): number {
  if (!(Number.isInteger(lookahead) && lookahead >= 0)) {
    throw new InvalidArgumentError(`lookahead must be non-negative (0 = lockstep), got ${lookahead}`);
  }
  return lookahead;
}
