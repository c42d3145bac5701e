/**
 * What a generation spent, as Python's `edge_sdk.privacy.accountant`: a policy states what one releasing step costs (a
 * {@link ReleaseEvent}); the decide step records one event per step that released something the mechanism
 * protects; {@link PrivacyAccountant.epsilon} composes them for the relation "any two private contexts":
 *
 * - `gaussian` (DP-Logit): the exact composition of Gaussian mechanisms;
 * - `renyi` (DP-Fusion, edge-side): a bound at one Renyi order, composed by adding, improved conversion;
 * - `pure_dp` (LDP-Sampler) at delta 0: `n * eps`, exact;
 * - `non_private` (the heuristics): `eps = inf` from the first release.
 *
 * - `zcdp` (InvisibleInk): dp-accounting's RDP accountant's composition and conversion, ported.
 *
 * - `pure_dp` at a delta > 0: dp-accounting's PLD accountant over binary randomised response, ported
 *   (`./pld.ts`; refused when built if its horizon needs dp-accounting's dense PMF).
 */

import { InvalidArgumentError } from "../core/errors.js";
import { pyG } from "../core/format.js";
import { checkDelta, checkOrder, gaussianCompositionEpsilon, rdpEpsilon, zcdpOptimalOrder } from "./accounting.js";
import { pureDpPldCurve } from "./pld.js";

export type ReleaseKind = "gaussian" | "zcdp" | "pure_dp" | "renyi" | "non_private";
export const RELEASE_KINDS: readonly ReleaseKind[] = ["gaussian", "zcdp", "pure_dp", "renyi", "non_private"];

/** Which accountant composes each kind (the summary's `accountant`). */
export const ACCOUNTANTS: Record<ReleaseKind, string> = {
  gaussian: "Gaussian composition (exact)",
  zcdp: "rdp (dp-accounting)",
  pure_dp: "pld (dp-accounting)",
  renyi: "renyi at one order, improved conversion (hand)",
  non_private: "none",
};

/** The neighbouring relation every `epsilon_spent` is stated for. */
export const RELATION = "any two private contexts";
/** The weaker relation of a source's own figure (`ReleaseEvent.sourceValue`). */
export const SOURCE_RELATION =
  "one private context against none (the public row only): the source's relation, weaker";

/** The privacy cost of one releasing step, in the form its source composes it (see the module comment). */
export class ReleaseEvent {
  readonly kind: ReleaseKind;
  readonly value: number;
  readonly delta: number;
  readonly order: number | null;
  readonly horizon: number | null;
  readonly note: string;
  readonly sourceValue: number | null;

  constructor(
    kind: ReleaseKind,
    value = Infinity,
    options: { delta?: number; order?: number | null; horizon?: number | null; note?: string;
      sourceValue?: number | null } = {},
  ) {
    if (!RELEASE_KINDS.includes(kind)) {
      throw new InvalidArgumentError(`release kind must be one of ${RELEASE_KINDS.join(", ")}, got '${kind}'`);
    }
    this.kind = kind;
    this.value = value;
    this.delta = options.delta ?? 0;
    this.order = options.order ?? null;
    this.horizon = options.horizon ?? null;
    this.note = options.note ?? "";
    this.sourceValue = options.sourceValue ?? null;
    if (kind === "non_private") {
      if (value !== Infinity) {
        throw new InvalidArgumentError(`a non-private release has an infinite epsilon, got ${value}`);
      }
      return;
    }
    if (!(value >= 0 && Number.isFinite(value))) {
      throw new InvalidArgumentError(`a ${kind} release needs a finite parameter >= 0, got ${value}`);
    }
    if (kind === "gaussian" && !(value > 0)) {
      throw new InvalidArgumentError(`a Gaussian release needs a noise multiplier > 0, got ${value}`);
    }
    if (kind === "renyi") checkOrder(this.order ?? NaN);
    if (this.sourceValue !== null && !(this.sourceValue >= 0 && this.sourceValue <= value)) {
      throw new InvalidArgumentError(
        `a source's weaker relation costs at most the event, got ${this.sourceValue} > ${value}`,
      );
    }
  }

  /** A release with no DP guarantee (`eps = inf`), with the reason. */
  static nonPrivate(note: string): ReleaseEvent {
    return new ReleaseEvent("non_private", Infinity, { note });
  }

  /** Whether the release carries a DP guarantee. */
  get isPrivate(): boolean {
    return this.kind !== "non_private";
  }

  /** A short label, e.g. `gaussian(noise_multiplier=1.23)`. */
  describe(): string {
    switch (this.kind) {
      case "gaussian":
        return `gaussian(noise_multiplier=${pyG(this.value, 6)})`;
      case "zcdp":
        return `zcdp(rho=${pyG(this.value, 6)})`;
      case "pure_dp":
        return `pure_dp(epsilon=${pyG(this.value, 6)})`;
      case "renyi":
        return `renyi(order=${pyG(this.order ?? NaN)}, epsilon=${pyG(this.value, 6)})`;
      default:
        return "non_private";
    }
  }

  withValue(value: number): ReleaseEvent {
    return new ReleaseEvent(this.kind, value, { delta: this.delta, order: this.order, horizon: this.horizon,
      note: this.note, sourceValue: null });
  }
}

/**
 * `(eps, delta)` of `n` releases each `(a, e)`-Renyi-DP at the one order `a`:
 * `eps(n) = n * e + log(1 - 1/a) - (log(delta) + log(a)) / (a - 1)` (0 when nothing or nothing private was released).
 */
export function renyiCompositionEpsilon(releases: number, stepRdp: number, order: number, delta: number): number {
  if (releases === 0 || stepRdp === 0) return 0;
  return rdpEpsilon(releases * stepRdp, order, delta);
}

function epsilonCurve(event: ReleaseEvent, delta: number): (releases: number) => number {
  if (event.kind === "non_private") return (releases) => (releases === 0 ? 0 : Infinity);
  if (event.value === 0) return () => 0; // the output ignores the private context
  if (event.kind === "pure_dp" && delta === 0) return (releases) => releases * event.value;
  if (event.kind === "renyi") {
    const order = event.order as number;
    return (releases) => renyiCompositionEpsilon(releases, event.value, order, delta);
  }
  if (event.kind === "gaussian") return (releases) => gaussianCompositionEpsilon(event.value, releases, delta);
  if (event.kind === "zcdp") return zcdpCurve(event, delta);
  return pureDpPldCurve(event.value, delta);
}

/** dp-accounting's default RDP orders (`DEFAULT_RDP_ORDERS`), which Python's zCDP accountant converts at. */
export const DEFAULT_RDP_ORDERS: readonly number[] = [
  ...Array.from({ length: 99 }, (_, x) => 1 + (x + 1) / 10),
  ...Array.from({ length: 53 }, (_, x) => 11 + x),
  128, 256, 512, 1024,
];

/**
 * `eps(n)` of `n` releases each `rho`-zCDP, as Python's accountant composes them with dp-accounting's RDP
 * accountant (ported here): at every order `a` of {@link DEFAULT_RDP_ORDERS} (plus the order the calibration
 * converted at, for a horizon) the releases add `rho * a` each, one after another; the epsilon is the smallest
 * over the orders of the improved conversion `r + log(1 - 1/a) - log(delta * a) / (a - 1)` (0 where
 * `delta^2 + expm1(-r) > 0`, the KL bound), floored at 0.  Memoised, as a generation asks for `n` and `n + 1`.
 */
function zcdpCurve(event: ReleaseEvent, delta: number): (releases: number) => number {
  const orders = [...DEFAULT_RDP_ORDERS];
  if (event.horizon !== null && event.value > 0) orders.push(zcdpOptimalOrder(event.horizon * event.value, delta));
  orders.sort((x, y) => x - y);
  const rdp = orders.map(() => 0);
  const epsilons = [0];
  return (releases) => {
    while (epsilons.length <= releases) {
      orders.forEach((order, j) => { rdp[j] += event.value * order; });
      const candidates = orders.map((order, j) => {
        const r = rdp[j];
        if (r < 0 || delta ** 2 + Math.expm1(-r) > 0) return 0;
        return order > 1.01 ? r + Math.log1p(-1 / order) - Math.log(delta * order) / (order - 1) : Infinity;
      });
      epsilons.push(Math.max(0, Math.min(...candidates)));
    }
    return epsilons[releases];
  };
}

/** The ledger's privacy summary (Python's `PrivacyAccountant.summary()`), JSON-ready. */
export interface PrivacySummary {
  guarantee: "dp" | "non-private";
  epsilon_spent: number | null;
  relation: string | null;
  source_relation: { relation: string; epsilon_spent: number } | null;
  delta: number;
  accountant: string;
  event: string;
  events: number;
  max_epsilon: number | null;
  withheld_from: number | null;
  withheld_reason: string | null;
  note: string;
}

/** The account of one generation: which steps released, what that spent, and the `maxEpsilon` budget. */
export class PrivacyAccountant {
  readonly event: ReleaseEvent;
  readonly delta: number;
  readonly maxEpsilon: number | null;
  readonly releaseSteps: number[] = [];
  /** The first step the budget withheld (`null` while it has not). */
  withheldFrom: number | null = null;
  private readonly curve: (releases: number) => number;
  private readonly sourceCurve: ((releases: number) => number) | null;

  /**
   * `options.horizon`: the most releases the generation can record (its `max_new_tokens`); the curve is composed
   * that far (and one more, what `wouldExceed` asks) here, so a composition this SDK does not implement is refused
   * now rather than mid-generation.
   */
  constructor(event: ReleaseEvent, options: { delta?: number | null; maxEpsilon?: number | null; horizon?: number } = {}) {
    this.event = event;
    const delta = options.delta ?? event.delta;
    if (event.kind === "gaussian" || event.kind === "zcdp" || event.kind === "renyi") checkDelta(delta);
    else if (!(delta >= 0 && delta < 1)) throw new InvalidArgumentError(`delta must lie in [0, 1), got ${delta}`);
    this.delta = delta;
    this.curve = epsilonCurve(event, delta);
    this.sourceCurve = event.sourceValue === null ? null : epsilonCurve(event.withValue(event.sourceValue), delta);
    if (options.horizon !== undefined) {
      this.curve(options.horizon + 1);
      this.sourceCurve?.(options.horizon + 1);
    }
    this.maxEpsilon = options.maxEpsilon ?? null;
    if (this.maxEpsilon !== null) {
      if (!(this.maxEpsilon >= 0 && Number.isFinite(this.maxEpsilon))) {
        throw new InvalidArgumentError(`max_epsilon must be finite and >= 0, got ${this.maxEpsilon}`);
      }
      const one = this.epsilon(1);
      if (event.isPrivate && this.maxEpsilon < one) {
        throw new InvalidArgumentError(
          `max_epsilon ${pyG(this.maxEpsilon)} cannot be met: one release of this policy already spends ` +
            `epsilon ${pyG(one, 4)} at delta ${pyG(this.delta)} (${RELATION}); the working range is max_epsilon >= ` +
            `${pyG(one, 4)} (or a smaller per-token epsilon, a larger delta)`,
        );
      }
    }
  }

  /** Which accountant composes the releases. */
  get accountant(): string {
    if (this.event.kind === "pure_dp" && this.delta === 0) return "basic composition (exact at delta 0)";
    return ACCOUNTANTS[this.event.kind];
  }

  /** How many steps released something the mechanism protects. */
  get releases(): number {
    return this.releaseSteps.length;
  }

  /** The epsilon spent at `delta` after `releases` releases (default: those recorded), any two contexts. */
  epsilon(releases: number = this.releases): number {
    return this.curve(releases);
  }

  /** The same releases for the source's weaker relation, `null` without one. */
  sourceEpsilon(releases: number = this.releases): number | null {
    return this.sourceCurve === null ? null : this.sourceCurve(releases);
  }

  /** Whether one more release would spend more than `maxEpsilon`. */
  wouldExceed(maxEpsilon: number): boolean {
    return this.epsilon(this.releases + 1) > maxEpsilon;
  }

  /**
   * Whether `step` must send only a cloud-only signal because the budget is spent: public numbers and the count
   * of releasing steps only; once it withholds, it withholds every later step.
   */
  withholds(step: number): boolean {
    if (this.withheldFrom === null && this.maxEpsilon !== null && this.wouldExceed(this.maxEpsilon)) {
      this.withheldFrom = step;
    }
    return this.withheldFrom !== null;
  }

  /** Record `step`'s signal, decided from the private context: a DP signal always, a heuristic's when steered. */
  record(step: number, steered: boolean): void {
    if (this.event.isPrivate || steered) this.releaseSteps.push(step);
  }

  /** Why the budget withheld, in words (`null` when it has not). */
  stopReason(): string | null {
    if (this.withheldFrom === null) return null;
    const after = this.epsilon(this.releases + 1);
    const spent = after === Infinity ? "no finite epsilon (non-private policy)" : `epsilon ${pyG(after, 4)}`;
    return `from step ${this.withheldFrom} only cloud-only signals were sent: one more release would spend ` +
      `${spent} > max_epsilon ${pyG(this.maxEpsilon ?? NaN)} at delta ${pyG(this.delta)}`;
  }

  summary(): PrivacySummary {
    const source = this.sourceEpsilon();
    return {
      guarantee: this.event.isPrivate ? "dp" : "non-private",
      epsilon_spent: this.event.isPrivate ? this.epsilon() : null,
      relation: this.event.isPrivate ? RELATION : null,
      source_relation: source === null ? null : { relation: SOURCE_RELATION, epsilon_spent: source },
      delta: this.delta,
      accountant: this.accountant,
      event: this.event.describe(),
      events: this.releases,
      max_epsilon: this.maxEpsilon,
      withheld_from: this.withheldFrom,
      withheld_reason: this.stopReason(),
      note: this.event.note,
    };
  }

  /** One line for people: what this generation spent. */
  describe(): string {
    const line = this.event.isPrivate
      ? `epsilon ${pyG(this.epsilon(), 4)} at delta ${pyG(this.delta)} over ${this.releases} releases, ${RELATION} ` +
        `(${this.event.describe()}, ${this.accountant})`
      : `non-private: ${this.event.note} (${this.releases} steps steered by the private context)`;
    const reason = this.stopReason();
    return reason === null ? line : `${line}; ${reason}`;
  }
}

/** `e^eps` for people: two significant figures, more below 1.1 so it never reads 1, powers of ten past a billion. */
export function oddsFactor(epsilon: number): string {
  if (epsilon === Infinity) return "unboundedly many";
  const odds = epsilon < 700 ? Math.exp(epsilon) : Infinity;
  if (epsilon === 0) return "1";
  if (odds === Infinity || odds >= 1e9) {
    const exponent = epsilon / Math.log(10);
    const whole = Math.floor(exponent);
    return `${pyG(10 ** (exponent - whole), 2)} × 10^${whole}`;
  }
  const digits = odds >= 1.1 ? 2 : 1 - Math.floor(Math.log10(Math.expm1(epsilon)));
  const rounded = Number(pyG(odds, digits));
  return rounded >= 100 ? Math.round(rounded).toLocaleString("en-US") : pyG(rounded);
}

/** What `epsilon` means to the person it protects, in one sentence. */
export function oddsSentence(epsilon: number, delta: number): string {
  const chance = delta > 0 ? `, except with probability ${pyG(delta)}` : "";
  return `whoever sees what left the device is at most ${oddsFactor(epsilon)} times more likely to tell your ` +
    `context from any other${chance} (e^epsilon, epsilon ${pyG(epsilon, 3)})`;
}
