/**
 * The privacy ledger: what left the device at each step of one generation, and why (Python: `edge_sdk.privacy.ledger`).
 * The loop writes it; apps read it.
 */

import type { FusionMode } from "../policies/base.js";
import { oddsSentence, type PrivacyAccountant, type PrivacySummary } from "./accountant.js";

/** What left the device at one step, and why (field names as Python's `LedgerEntry`). */
export interface LedgerEntry {
  step: number;
  token_id: number;
  policy: string;
  signal: "upload" | "token";
  values_uploaded: number;
  full_requested: boolean;
  withheld: boolean;
  steered: boolean;
  bytes_up: number;
  bytes_down: number;
  leak_share: number;
  edge_ms: number;
  wait_ms: number;
  cloud_forward_ms: number;
  /** DecodeLeak's `E_t^K`: the top-K ids the cloud can read off this step. */
  exposure: number[];
  sends: number;
  full_requests: number;
  pace_overrun: boolean;
}

/** Per-step record of everything that left the device in one generation. */
export class PrivacyLedger {
  readonly entries: LedgerEntry[] = [];
  reconnects = 0;
  prefillOverrun = false;
  readonly sessionIds: string[] = [];
  cloudModel: string | null = null;

  constructor(
    readonly mode: FusionMode,
    readonly policy: string,
    readonly exposureK: number,
    readonly accountant: PrivacyAccountant | null = null,
  ) {}

  get bytesUp(): number {
    return this.entries.reduce((sum, entry) => sum + entry.bytes_up, 0);
  }

  get bytesDown(): number {
    return this.entries.reduce((sum, entry) => sum + entry.bytes_down, 0);
  }

  get fullRequests(): number {
    return this.entries.reduce((sum, entry) => sum + entry.full_requests, 0);
  }

  get valuesUploaded(): number {
    return this.entries.reduce((sum, entry) => sum + entry.values_uploaded, 0);
  }

  get leakShare(): number {
    return this.entries.length ? this.entries[this.entries.length - 1].leak_share : 0;
  }

  /** DecodeLeak's exposure sequence `{E_t^K}` as the edge recorded it. */
  exposureTrace(): { k: number; sets: number[][] } {
    return { k: this.exposureK, sets: this.entries.map((entry) => entry.exposure) };
  }

  /** `[steps, values]`: steps that released something decided from the private context, and the values sent. */
  revealed(): [number, number] {
    if (this.accountant === null) return [0, 0];
    const released = new Set(this.accountant.releaseSteps);
    const entries = this.entries.filter((entry) => released.has(entry.step));
    return [entries.length,
      entries.reduce((sum, entry) => sum + (entry.signal === "upload" ? entry.values_uploaded : 1), 0)];
  }

  /** What the generation's privacy means to the person: the odds next to a DP policy's epsilon, counts otherwise. */
  inWords(): string | null {
    if (this.accountant === null) return null;
    if (this.accountant.event.isPrivate) return oddsSentence(this.accountant.epsilon(), this.accountant.delta);
    const [steps, values] = this.revealed();
    return `no DP guarantee (a heuristic): ${steps} of ${this.entries.length} steps revealed ${values} values ` +
      "decided by your private context";
  }

  /** The epsilon ledger (the accountant's summary and `in_words`). */
  privacy(): (PrivacySummary & { in_words: string | null }) | null {
    if (this.accountant === null) return null;
    return { ...this.accountant.summary(), in_words: this.inWords() };
  }
}

/** What share of the private context's content tokens the cloud has observed so far (every exposure set and
 * synced token observed): `|T(private) ∩ exposed| / |T(private)|`, 0 without content tokens. */
export class LeakageMeter {
  readonly exposed = new Set<number>();

  constructor(readonly privateContentIds: ReadonlySet<number>) {}

  observe(ids: Iterable<number>): void {
    for (const id of ids) this.exposed.add(id);
  }

  get share(): number {
    if (this.privateContentIds.size === 0) return 0;
    let leaked = 0;
    for (const id of this.privateContentIds) if (this.exposed.has(id)) leaked++;
    return leaked / this.privateContentIds.size;
  }
}
