/**
 * Test doubles for the loop: a scripted cloud speaking the protocol over a {@link MessageChannel} (its rows a fixed
 * table, its picks argmax of the fusion written out here id by id) and a table SLM.
 */

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import type { SLMBackend } from "../src/backends/base.js";
import { Inbox, type MessageChannel } from "../src/carriers/channel.js";
import { CloudError } from "../src/core/errors.js";
import {
  CloudMessageSchema,
  EdgeMessageSchema,
  idsFromBytes,
  idsToBytes,
  valuesFromBytes,
  valuesToBytes,
  type CloudMessage,
  type EdgeMessage,
} from "../src/wire/index.js";

/** An SLM whose row after `n` tokens is `rows[n - promptLength]` (probabilities, or raw logits). */
export class TableSLM implements SLMBackend {
  readonly name = "table";
  readonly eosTokenIds: ReadonlySet<number> = new Set([0]);
  private length = 0;
  private promptLength = 0;
  readonly appended: number[] = [];

  constructor(readonly rows: number[][], readonly rowKind: "logits" | "probabilities" = "probabilities") {}

  get vocabSize(): number {
    return this.rows[0].length;
  }

  async tokenize(text: string): Promise<number[]> {
    return Array.from(text, (c) => c.charCodeAt(0) % this.vocabSize);
  }

  async detokenize(ids: readonly number[]): Promise<string> {
    return ids.join(",");
  }

  async vocabFingerprint(): Promise<Uint8Array> {
    return Uint8Array.from([7, 7]);
  }

  async prefill(ids: readonly number[]): Promise<Float32Array> {
    this.promptLength = ids.length;
    this.length = ids.length;
    return Float32Array.from(this.rows[0]);
  }

  async append(tokenId: number): Promise<Float32Array> {
    this.appended.push(tokenId);
    this.length++;
    return Float32Array.from(this.rows[Math.min(this.length - this.promptLength, this.rows.length - 1)]);
  }
}

/** `ids` by decreasing value, ties to the lower id, written as a sort. */
function ranked(row: number[]): number[] {
  return row.map((_, i) => i).sort((a, b) => row[b] - row[a] || a - b);
}

export interface ScriptOptions {
  /** the cloud's row (probabilities) at each step */
  rows: number[][];
  topM?: number;
  maxNewTokens?: number;
  /** the run-ahead depth the cloud agrees to (at most the edge's) */
  lookahead?: number;
  /** rewrite each message the cloud sends (a lying cloud) */
  tamper?: (message: CloudMessage) => CloudMessage;
}

/** The cloud's side of every session opened on it; `sessions[i]` holds the i-th session's edge messages. */
export class ScriptedCloud {
  readonly sessions: EdgeMessage[][] = [];
  readonly sentBytes: string[][] = [];
  /** break the stream (UNAVAILABLE) once the edge has sent this many messages in the current session */
  breakAfter: number | null = null;

  constructor(readonly options: ScriptOptions) {}

  channel(): ScriptedChannel {
    return new ScriptedChannel(this);
  }
}

export class ScriptedChannel implements MessageChannel {
  readonly crossesNetwork = false;
  private readonly inbox = new Inbox();
  private messages: EdgeMessage[] | null = null;
  private bytes: string[] = [];
  private tokens: number[] = [];
  private alpha = 0.3;
  private mode = 0;
  private topM = 2;
  private lookahead = 0;
  private maxNew = 0;

  constructor(private readonly cloud: ScriptedCloud) {}

  private reply(message: CloudMessage): void {
    const tampered = this.cloud.options.tamper?.(message) ?? message;
    this.inbox.push(toBinary(CloudMessageSchema, tampered));
  }

  private row(step: number): number[] {
    const rows = this.cloud.options.rows;
    return rows[Math.min(step, rows.length - 1)];
  }

  private sendRow(step: number, assumes?: number, full = false): void {
    const row = this.row(step);
    if (full) {
      this.reply(create(CloudMessageSchema, { kind: { case: "distribution", value: { step: BigInt(step), dense: valuesToBytes(row) } } }));
      return;
    }
    const top = ranked(row).slice(0, this.topM);
    const sent = top.map((i) => row[i]);
    const omitted = row.length - top.length;
    const tailMass = omitted ? Math.max(0, 1 - sent.reduce((a, b) => a + Math.fround(b), 0)) : 0;
    this.reply(create(CloudMessageSchema, {
      kind: {
        case: "distribution",
        value: { step: BigInt(step), ids: idsToBytes(top), values: valuesToBytes(sent), tailBound: omitted ? sent[sent.length - 1] : 0,
          tailMass, ...(assumes === undefined ? {} : { assumesToken: assumes }) },
      },
    }));
  }

  /** The cloud's own greedy draft after `step`'s row: its top token. */
  private draft(step: number): number {
    return ranked(this.row(step))[0];
  }

  private finishedAfter(token: number, step: number): boolean {
    return token === 0 || step + 1 >= this.maxNew;
  }

  async send(bytes: Uint8Array): Promise<void> {
    const message = fromBinary(EdgeMessageSchema, bytes);
    if (this.messages === null) {
      this.messages = [];
      this.cloud.sessions.push(this.messages);
      this.cloud.sentBytes.push(this.bytes);
    }
    this.messages.push(message);
    this.bytes.push(Buffer.from(bytes).toString("hex"));
    if (this.cloud.breakAfter !== null && this.messages.length >= this.cloud.breakAfter) {
      this.cloud.breakAfter = null;
      this.inbox.end(new CloudError("UNAVAILABLE", "the link broke", { retryable: true }));
      return;
    }
    const kind = message.kind;
    if (kind.case === "open") {
      const open = kind.value;
      this.tokens = [...idsFromBytes(open.resumePrefix?.ids ?? new Uint8Array())];
      this.alpha = open.alpha;
      this.mode = open.mode;
      this.topM = open.topM;
      this.lookahead = Math.min(open.lookahead, this.cloud.options.lookahead ?? 0);
      this.maxNew = this.cloud.options.maxNewTokens ?? open.maxNewTokens;
      this.reply(create(CloudMessageSchema, { kind: { case: "opened", value: { sessionId: `s${this.cloud.sessions.length}`,
        protocolVersion: 1, vocabSize: this.row(0).length, eosTokenIds: { ids: idsToBytes([0]) }, maxNewTokens: this.maxNew,
        lookahead: this.lookahead, padded: open.padded } } }));
      this.rowsFrom(this.tokens.length);
    } else if (kind.case === "requestFull") {
      this.sendRow(Number(kind.value.step), undefined, true);
    } else if (kind.case === "signal") {
      const step = Number(kind.value.step);
      let token: number;
      if (kind.value.signal.case === "tokenId") {
        token = kind.value.signal.value;
      } else {
        const upload = kind.value.signal.value!;
        const values = valuesFromBytes(upload.values);
        const ids = upload.dense ? values.map((_, i) => i) : idsFromBytes(upload.ids);
        const fused = this.row(step).map((p) => this.alpha * p);
        ids.forEach((id, j) => (fused[id] += (1 - this.alpha) * values[j]));
        token = ranked(fused)[0];
      }
      this.tokens.push(token);
      const finished = this.finishedAfter(token, step);
      if (kind.value.signal.case === "upload") {
        this.reply(create(CloudMessageSchema, { kind: { case: "token", value: { step: BigInt(step), tokenId: token, finished } } }));
      }
      if (finished) {
        this.reply(create(CloudMessageSchema, { kind: { case: "finished", value: { steps: BigInt(step + 1), reason: token === 0 ? "eos" : "max_new_tokens" } } }));
      } else {
        this.rowsFrom(step + 1, token);
      }
    } else if (kind.case === "close") {
      this.reply(create(CloudMessageSchema, { kind: { case: "finished", value: { steps: BigInt(this.tokens.length), reason: "closed" } } }));
    }
  }

  /** Rows sent ahead past the last confirmed step, each `[step, the token it assumes]`. */
  private chain: [number, number][] = [];

  /** `step`'s row after `confirmed` (unless a draft already assumed it) and, running ahead, drafts past it up to
   * the agreed depth, each assuming the cloud's own top token of the row before. */
  private rowsFrom(first: number, confirmed?: number): void {
    const ahead = this.lookahead > 0;
    if (ahead && this.chain.length && this.chain[0][0] === first && this.chain[0][1] === confirmed) {
      this.chain.shift();
    } else {
      this.chain = [];
      this.sendRow(first, ahead ? confirmed : undefined);
    }
    if (!ahead) return;
    let step = this.chain.length ? this.chain[this.chain.length - 1][0] : first;
    let assumes = this.draft(step);
    while (step + 1 < this.maxNew && step + 1 <= first + this.lookahead && assumes !== 0) {
      step++;
      this.sendRow(step, assumes);
      this.chain.push([step, assumes]);
      assumes = this.draft(step);
    }
  }

  receive(): Promise<Uint8Array> {
    return this.inbox.next();
  }

  close(): void {
    this.inbox.end(new CloudError("CANCELLED", "closed"));
  }
}
