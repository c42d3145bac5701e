import { create } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";
import { CloudError } from "../src/core/errors.js";
import { CloudConnection } from "../src/loop/connection.js";
import { CollaborativeDecoder, runWithResume, type StepEvent } from "../src/loop/decoder.js";
import { Undefended } from "../src/policies/undefended.js";
import { decodeSettings } from "../src/loop/settings.js";
import { CloudMessageSchema, idsFromBytes, PbFusionSpace, valuesToBytes, type CloudMessage } from "../src/wire/index.js";
import { ScriptedCloud, TableSLM } from "./scripted.js";

// vocabulary of 4; id 0 ends the generation.  Rows worked by hand:
// step 0: SLM [0, .6, .3, .1], cloud [0, .2, .7, .1]: fused (alpha .3) id1 .48, id2 .42 -> 1
// step 1: SLM [0, .1, .1, .8], cloud [0, .5, .4, .1]: id3 .59, id1 .22 -> 3
// step 2: SLM [.9, .1, 0, 0], cloud [.1, .8, .1, 0]: id0 .66 -> 0 (end)
const SLM_ROWS = [[0, 0.6, 0.3, 0.1], [0, 0.1, 0.1, 0.8], [0.9, 0.1, 0, 0]];
const CLOUD_ROWS = [[0, 0.2, 0.7, 0.1], [0, 0.5, 0.4, 0.1], [0.1, 0.8, 0.1, 0]];

async function collect(events: AsyncGenerator<StepEvent>): Promise<StepEvent[]> {
  const out: StepEvent[] = [];
  for await (const event of events) out.push(event);
  return out;
}

function decoder(mode: "cloud" | "edge", extra: Record<string, unknown> = {}) {
  return new CollaborativeDecoder(new TableSLM(SLM_ROWS), new Undefended(), { mode, maxNewTokens: 8, topM: 2, exposureK: 2, autoPaceMs: null, ...extra },
    { slmPrompt: [1, 2, 3], cloudPrompt: [2, 3] });
}

describe("the loop of named steps", () => {
  it("edge-side: decides each token from the fused rows and ledgers every step", async () => {
    const cloud = new ScriptedCloud({ rows: CLOUD_ROWS });
    const d = decoder("edge");
    const events = await collect(d.steps(new CloudConnection(cloud.channel())));
    expect(events.map((e) => e.tokenId)).toEqual([1, 3, 0]);
    expect(d.finishReason).toBe("eos");
    const sent = cloud.sessions[0].map((m) => m.kind.case);
    expect(sent).toEqual(["open", "signal", "signal", "signal"]);
    // every token signal is padded to the longest token id's size (step 0's template leaves the step out)
    const sizes = cloud.sentBytes[0].slice(1).map((hex) => hex.length / 2);
    expect(sizes).toEqual([10, 12, 12]);
    // steered: the token is not the cloud's own top (2, then 1, then 1)
    expect(d.ledger.entries.map((e) => [e.step, e.signal, e.sends, e.steered])).toEqual([
      [0, "token", 1, true], [1, "token", 1, true], [2, "token", 1, true],
    ]);
    expect(d.ledger.entries.map((e) => e.bytes_up)).toEqual(sizes);
    expect(d.ledger.entries[0].exposure).toEqual([2, 1]); // edge-side E_t^K: the cloud's own top 2
  });

  it("edge-side logprobs: read off the fused row each token was chosen from, none asked of the cloud", async () => {
    const cloud = new ScriptedCloud({ rows: CLOUD_ROWS });
    const d = decoder("edge", { logprobs: 2, topM: 4 }); // the cloud sends whole rows: no public fill
    const events = await collect(d.steps(new CloudConnection(cloud.channel())));
    // fused rows (alpha .3, see above): [0, .48, .42, .10], [0, .22, .19, .59], [.66, .31, .03, 0], each summing to 1
    const want = [[1, 0.48, [[1, 0.48], [2, 0.42]]], [3, 0.59, [[3, 0.59], [1, 0.22]]], [0, 0.66, [[0, 0.66], [1, 0.31]]]] as const;
    expect(events.map((e) => e.logprobs?.tokenId)).toEqual(want.map(([token]) => token));
    events.forEach((event, t) => {
      expect(event.logprobs!.logprob).toBeCloseTo(Math.log(want[t][1]), 6); // float32 rows: 6 decimals
      expect(event.logprobs!.top.map(([id]) => id)).toEqual(want[t][2].map(([id]) => id));
      event.logprobs!.top.forEach(([, value], j) => expect(value).toBeCloseTo(Math.log(want[t][2][j][1]), 6));
    });
    const open = cloud.sessions[0][0].kind;
    expect(open.case === "open" && [open.value.logprobs, open.value.topLogprobs]).toEqual([false, 0]);
  });

  it("logit space with an SLM that gives raw logits: fuses z = .3 z_llm + .7 z_slm, and its logprobs are z - logsumexp(z)", async () => {
    // step 0: SLM [0, 2, 1, 0], cloud [0, 0, 3, 0]: z = [0, 1.4, 1.6, 0] -> 2 (a probability-space reading of the
    // same numbers would not be a distribution); step 1: SLM [3, 0, 0, 1], cloud [1, 2, 0, 0]: z = [2.4, .6, 0, .7] -> 0
    const cloud = new ScriptedCloud({ rows: [[0, 0, 3, 0], [1, 2, 0, 0]] });
    const d = new CollaborativeDecoder(new TableSLM([[0, 2, 1, 0], [3, 0, 0, 1]], "logits"), new Undefended({ space: "logit" }),
      { mode: "edge", maxNewTokens: 8, topM: 4, exposureK: 2, autoPaceMs: null, logprobs: 1 }, { slmPrompt: [1], cloudPrompt: [2] });
    const events = await collect(d.steps(new CloudConnection(cloud.channel())));
    expect(events.map((e) => e.tokenId)).toEqual([2, 0]);
    const open = cloud.sessions[0][0].kind;
    expect(open.case === "open" && open.value.space).toBe(PbFusionSpace.LOGIT);
    const logsumexp = Math.log(1 + Math.exp(1.4) + Math.exp(1.6) + 1);
    expect(events[0].logprobs!.logprob).toBeCloseTo(1.6 - logsumexp, 6);
    expect(events[0].logprobs!.top.map(([id]) => id)).toEqual([2]);
  });

  it("the open asks for padding, the edge's run-ahead depth, and top_m >= K edge-side", async () => {
    const cloud = new ScriptedCloud({ rows: CLOUD_ROWS });
    const d = new CollaborativeDecoder(new TableSLM(SLM_ROWS), new Undefended(), { mode: "edge", topM: 1, exposureK: 3, autoPaceMs: null },
      { slmPrompt: [1], cloudPrompt: [2, 3] });
    await collect(d.steps(new CloudConnection(cloud.channel(), 5)));
    const open = cloud.sessions[0][0].kind;
    expect(open.case).toBe("open");
    if (open.case !== "open") return;
    expect([open.value.padded, open.value.lookahead, open.value.topM, open.value.seed]).toEqual([true, 5, 3, 0n]);
    expect(Array.from(idsFromBytes(open.value.publicQuery.case === "tokenIds" ? open.value.publicQuery.value.ids : new Uint8Array()))).toEqual([2, 3]);
  });

  it("cloud-side: uploads every SLM value (undefended) and takes the cloud's picks", async () => {
    const cloud = new ScriptedCloud({ rows: CLOUD_ROWS });
    const d = decoder("cloud");
    const events = await collect(d.steps(new CloudConnection(cloud.channel())));
    expect(events.map((e) => e.tokenId)).toEqual([1, 3, 0]);
    expect(d.ledger.entries[0].values_uploaded).toBe(4);
    expect(d.ledger.entries[0].exposure).toEqual([1, 2]); // TopK of the upload [0, .6, .3, .1]
  });

  it("a broken stream resumes: the acknowledged tokens reopen the session and the step's signal is re-sent byte for byte", async () => {
    const cloud = new ScriptedCloud({ rows: CLOUD_ROWS });
    cloud.breakAfter = 3; // open, step 0's upload, step 1's upload: the link breaks before the cloud's pick of step 1
    const d = decoder("cloud");
    const events = await collect(runWithResume(d, () => new CloudConnection(cloud.channel()), { backoffMs: 1 }));
    expect(events.map((e) => e.tokenId)).toEqual([1, 3, 0]);
    expect(d.ledger.reconnects).toBe(1);
    const resumed = cloud.sessions[1][0].kind;
    expect(resumed.case === "open" && Array.from(idsFromBytes(resumed.value.resumePrefix!.ids))).toEqual([1]);
    expect(cloud.sentBytes[1][1]).toBe(cloud.sentBytes[0][2]); // step 1's signal, the same bytes again
    expect(d.ledger.entries[1].sends).toBe(2);
    expect(d.ledger.entries[1].bytes_up).toBe(2 * (cloud.sentBytes[0][2].length / 2));
  });

  it("run-ahead: drafted rows that assumed another token are dropped; the tokens are lockstep's", async () => {
    const lockstep = new ScriptedCloud({ rows: CLOUD_ROWS });
    const ahead = new ScriptedCloud({ rows: CLOUD_ROWS, lookahead: 2 });
    const d1 = decoder("edge");
    const d2 = decoder("edge");
    const tokens1 = (await collect(d1.steps(new CloudConnection(lockstep.channel())))).map((e) => e.tokenId);
    const connection = new CloudConnection(ahead.channel(), 4);
    const tokens2 = (await collect(d2.steps(connection))).map((e) => e.tokenId);
    expect(tokens2).toEqual(tokens1);
    expect(connection.rowsDropped).toBeGreaterThan(0); // the cloud drafted 2 after step 0 where the edge chose 1
    expect(ahead.sentBytes[0].slice(1)).toEqual(lockstep.sentBytes[0].slice(1)); // the same messages up, in order
  });

  it("DecodeSettings.lookahead is the depth the session asks for, over the connection's; null leaves the connection's", async () => {
    const asked = [];
    for (const lookahead of [2, 0, null]) {
      const cloud = new ScriptedCloud({ rows: CLOUD_ROWS, lookahead: 4 });
      const connection = new CloudConnection(cloud.channel(), 5);
      const tokens = (await collect(decoder("edge", { lookahead }).steps(connection))).map((e) => e.tokenId);
      expect(tokens).toEqual([1, 3, 0]); // the rows worked by hand above, whatever the depth
      const open = cloud.sessions[0][0].kind;
      asked.push([open.case === "open" ? open.value.lookahead : -1, connection.runAhead]);
    }
    expect(asked).toEqual([[2, true], [0, false], [5, true]]);
  });

  it("cloud-side run-ahead takes certified picks without waiting, and checks each against the cloud's", async () => {
    const cloud = new ScriptedCloud({ rows: CLOUD_ROWS, lookahead: 2, topM: 4 });
    const d = decoder("cloud", { topM: 4 });
    const connection = new CloudConnection(cloud.channel(), 2);
    expect((await collect(d.steps(connection))).map((e) => e.tokenId)).toEqual([1, 3, 0]);
    expect(connection.picksCertified).toBe(2); // steps 0 and 1; the last token is always read from the cloud
    expect(connection.stepsAcknowledged).toBe(3);
  });

  it("a cloud whose pick contradicts the certificate ends the session with DATA_LOSS", async () => {
    const lie = (m: CloudMessage): CloudMessage =>
      m.kind.case === "token" && m.kind.value.step === 0n ? create(CloudMessageSchema, { kind: { case: "token", value: { ...m.kind.value, tokenId: 2 } } }) : m;
    const cloud = new ScriptedCloud({ rows: CLOUD_ROWS, lookahead: 2, tamper: lie });
    const d = decoder("cloud", { topM: 4 });
    await expect(collect(d.steps(new CloudConnection(cloud.channel(), 2)))).rejects.toMatchObject({ code: "DATA_LOSS" });
  });

  it("a lying cloud: too few values, or a row that is not a distribution, is DATA_LOSS; a wrong step INTERNAL", async () => {
    const shorten = (m: CloudMessage): CloudMessage =>
      m.kind.case === "distribution" ? create(CloudMessageSchema, { kind: { case: "distribution", value: { ...m.kind.value,
        ids: m.kind.value.ids.slice(0, 4), values: m.kind.value.values.slice(0, 4) } } }) : m;
    const inflate = (m: CloudMessage): CloudMessage =>
      m.kind.case === "distribution" ? create(CloudMessageSchema, { kind: { case: "distribution", value: { ...m.kind.value,
        values: valuesToBytes([0.9, 0.8]) } } }) : m;
    const skip = (m: CloudMessage): CloudMessage =>
      m.kind.case === "distribution" ? create(CloudMessageSchema, { kind: { case: "distribution", value: { ...m.kind.value, step: 5n } } }) : m;
    for (const [tamper, code, text] of [[shorten, "DATA_LOSS", "fewer than the 2"], [inflate, "DATA_LOSS", "not a distribution"],
      [skip, "INTERNAL", "expected 0"]] as const) {
      const cloud = new ScriptedCloud({ rows: CLOUD_ROWS, tamper });
      const error = await collect(decoder("edge").steps(new CloudConnection(cloud.channel()))).catch((e: unknown) => e);
      expect(error).toBeInstanceOf(CloudError);
      expect(error).toMatchObject({ code });
      expect((error as CloudError).message).toContain(text);
    }
  });

  it("the exposure budget withholds once its share of steered steps is spent: the cloud's own top token", async () => {
    const cloud = new ScriptedCloud({ rows: CLOUD_ROWS });
    const d = decoder("edge", { exposureBudget: 0.125, maxNewTokens: 8 }); // floor(0.125 * 8) = 1 steered step
    const events = await collect(d.steps(new CloudConnection(cloud.channel())));
    expect(events[0].tokenId).toBe(1); // steered (the cloud's top is 2)
    expect(events[1].entry.withheld).toBe(true);
    expect(events[1].tokenId).toBe(1); // step 1's cloud row [0, .5, .4, .1]: its own top
  });

  it("settings and policies the TypeScript SDK does not implement are refused at construction", () => {
    expect(() => decodeSettings({ alphaa: 1 } as never)).toThrow(/unknown decode setting alphaa/);
    expect(() => decodeSettings({ exposureBudget: 2 })).toThrow(/exposure_budget must lie in \[0, 1\]/);
    expect(() => decoder("edge", { logprobs: 21 })).toThrow(/logprobs must lie in 0..20/);
    expect(() => new CollaborativeDecoder(new TableSLM(SLM_ROWS), new Undefended({ space: "logit" }), { mode: "edge" },
      { slmPrompt: [1], cloudPrompt: [1] })).toThrow(/probabilities only/);
    expect(() => decoder("edge", { alpha: 2 })).toThrow(/alpha/); // the core's check, at construction
  });

  it("a stopping rule: no end while it disallows one (edge-side the end ids leave the choice), and it ends the generation", async () => {
    const cloud = new ScriptedCloud({ rows: CLOUD_ROWS });
    // the table SLM detokenizes to "1,3,...": no end before 3 tokens; done at 4
    const rule = { allowsEnd: (text: string) => text.split(",").length >= 3, isDone: (text: string) => text.split(",").length >= 4 };
    const d = new CollaborativeDecoder(new TableSLM(SLM_ROWS), new Undefended(), { mode: "edge", maxNewTokens: 8, topM: 2, exposureK: 2, autoPaceMs: null },
      { slmPrompt: [1, 2, 3], cloudPrompt: [2, 3], stopping: rule });
    const events = await collect(d.steps(new CloudConnection(cloud.channel())));
    // step 2 fused: id0 .66 (an end id, out of the choice), id1 .07 + .24 = .31 -> 1; step 3 (row 2 again): 0 is allowed
    expect(events.map((e) => e.tokenId)).toEqual([1, 3, 1, 0]);
    expect(d.finishReason).toBe("eos");
    const d2 = new CollaborativeDecoder(new TableSLM(SLM_ROWS), new Undefended(), { mode: "edge", maxNewTokens: 8, topM: 2, exposureK: 2, autoPaceMs: null },
      { slmPrompt: [1, 2, 3], cloudPrompt: [2, 3], stopping: { allowsEnd: () => false, isDone: (text: string) => text.split(",").length >= 3 } });
    expect((await collect(d2.steps(new CloudConnection(new ScriptedCloud({ rows: CLOUD_ROWS }).channel())))).length).toBe(3);
    expect(d2.finishReason).toBe("stop_rule");
  });

  it("paced: each signal leaves on the public grid, pace_ms apart at least, whatever the SLM took", async () => {
    const cloud = new ScriptedCloud({ rows: CLOUD_ROWS });
    const sentAt: number[] = [];
    const channel = cloud.channel();
    const send = channel.send.bind(channel);
    channel.send = (bytes: Uint8Array) => {
      sentAt.push(performance.now());
      return send(bytes);
    };
    const d = decoder("edge", { paceMs: 40 });
    await collect(d.steps(new CloudConnection(channel)));
    // signal k leaves at the grid's k-th point or later: the grid starts when the open's answer came (after the open
    // left), so k * 40 ms after the open at least (never early: the pacer waits again what a timer left)
    expect(sentAt.length).toBe(4);
    sentAt.slice(1).forEach((t, k) => expect(t - sentAt[0]).toBeGreaterThanOrEqual(40 * (k + 1)));
    // unpaced, the same decode sends at once
    const quick: number[] = [];
    const other = new ScriptedCloud({ rows: CLOUD_ROWS }).channel();
    const sendOther = other.send.bind(other);
    other.send = (bytes: Uint8Array) => (quick.push(performance.now()), sendOther(bytes));
    await collect(decoder("edge").steps(new CloudConnection(other)));
    expect(quick[3] - quick[0]).toBeLessThan(3 * 40); // paced, the third signal leaves 120 ms after the open at least
  });
});

