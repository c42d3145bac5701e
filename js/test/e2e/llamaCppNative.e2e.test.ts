/**
 * LlamaCppNativeSLM (the SDK's own addon over node-llama-cpp's libllama) against NodeLlamaCppSLM on the embedded
 * GGUF: the same library, model and context settings, so the same tokenizer and the same numbers.  node-llama-cpp
 * hands out probabilities, the native backend logits (`rowKind: "logits"`): the reference turns the native logits into probabilities as
 * node-llama-cpp's addon does (sorted by logit, descending; float32 exp(z - max), summed in that order, divided), with
 * V8's `Math.exp` rounded to float32 standing in for glibc's `expf`.  The two exps round apart on about one id in
 * 1,600, so those ids differ by an ulp or two and every other id is equal bit for bit (the float32 sum over all
 * 262,144 ids equal too: a logit off by an ulp anywhere would show).
 *
 * Built against llama-cpp-python's library (`llamaCpp: "llama-cpp-python"`), its logits are the Python SDK's
 * `LlamaCppSLM`'s bit for bit, computed by `python_rows.py` in the repository's Python.
 */

import { execFile } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";
import { getLlama, type Llama } from "node-llama-cpp";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { LlamaCppNativeSLM, NativeAddonMissingError } from "../../src/backends/llamaCppNative.js";
import { NodeLlamaCppSLM } from "../../src/backends/nodeLlamaCpp.js";
import { argmax, softmax } from "../../src/core/fusion.js";
import { PYTHON, REPO, embeddedGguf, ulps } from "./adapter.js";

let llama: Llama;
let native: LlamaCppNativeSLM;
let nativeProbabilities: LlamaCppNativeSLM;
let reference: NodeLlamaCppSLM;

beforeAll(async () => {
  llama = await getLlama({ gpu: false, build: "never", logLevel: "error" as never });
  const { path } = await embeddedGguf();
  native = await LlamaCppNativeSLM.load(path, { threads: 1, rowKind: "logits" });
  nativeProbabilities = await LlamaCppNativeSLM.load(path, { threads: 1 });
  reference = await NodeLlamaCppSLM.load(path, { llama, threads: 1 });
}, 120_000);

afterAll(async () => {
  await native?.close();
  await nativeProbabilities?.close();
  await reference?.close();
});

/** node-llama-cpp 3.21.1's probabilities from logits (AddonContext.cpp's SampleToken), in float32. */
function sortedSoftmax(logits: Float32Array): Float32Array {
  const sorted = Float32Array.from(logits).sort().reverse(); // descending; ties are equal values, any order sums alike
  const max = sorted[0];
  let sum = 0;
  for (const z of sorted) sum = Math.fround(sum + Math.fround(Math.exp(Math.fround(z - max))));
  return logits.map((z) => Math.fround(Math.fround(Math.exp(Math.fround(z - max))) / sum));
}

describe("LlamaCppNativeSLM", () => {
  it("has node-llama-cpp's vocabulary, end ids and tokenizer", async () => {
    expect(native.vocabSize).toBe(reference.vocabSize);
    expect([...native.eosTokenIds].sort()).toEqual([...reference.eosTokenIds].sort());
    expect(await native.vocabFingerprint()).toEqual(await reference.vocabFingerprint());
    const text = "Patient: María O'Neil, 67 — BP 142/91 mmHg.\n\nQuestion: what now?";
    for (const addBos of [true, false]) {
      const ids = await native.tokenize(text, { addBos });
      expect(ids).toEqual(await reference.tokenize(text, { addBos }));
      expect(await native.detokenize(ids)).toBe(await reference.detokenize(ids));
    }
  });

  it("gives logits whose softmax is node-llama-cpp's probabilities (bit for bit but where two exps round apart), over a prefill and three appends", async () => {
    expect(native.rowKind).toBe("logits");
    const prompt = await native.tokenize("The patient was admitted with chest pain and", { addBos: true });
    let logits = await native.prefill(prompt);
    let probabilities = await reference.prefill(prompt);
    for (let step = 0; ; step++) {
      expect(logits.length).toBe(native.vocabSize);
      const expected = sortedSoftmax(logits);
      let differing = 0;
      let worst = 0;
      for (let i = 0; i < expected.length; i++) {
        if (expected[i] === probabilities[i]) continue;
        differing++;
        worst = Math.max(worst, ulps(expected[i], probabilities[i]));
      }
      // measured: 145-170 ids of 262,144 per row, at most 2 ulps apart (one ulp of exp, carried through the division);
      // logits that differ at all (flash attention off, say) move the sum, and then nearly every id differs
      expect(differing, `row ${step}: ids whose probability differs`).toBeLessThan(expected.length / 1000);
      expect(worst, `row ${step}: the largest difference, in float32 ulps`).toBeLessThanOrEqual(2);
      if (step === 3) break;
      const next = argmax(logits);
      expect(next).toBe(argmax(probabilities));
      [logits, probabilities] = [await native.append(next), await reference.append(next)];
    }
  }, 120_000);

  it("by default gives probabilities: the SDK's softmax of its logits bit for bit, computed in the addon", async () => {
    expect(nativeProbabilities.rowKind).toBe("probabilities");
    const prompt = await native.tokenize("Question: which drug lowers blood pressure?\nAnswer:", { addBos: true });
    let logits = await native.prefill(prompt);
    let probabilities = await nativeProbabilities.prefill(prompt);
    for (let step = 0; step < 3; step++) {
      const expected = softmax(logits); // the TypeScript softmax the decoder applies to a logits row
      expect(Buffer.from(probabilities.buffer, probabilities.byteOffset, probabilities.byteLength)
        .equals(Buffer.from(expected.buffer, expected.byteOffset, expected.byteLength)), `row ${step}`).toBe(true);
      const next = argmax(logits);
      [logits, probabilities] = [await native.append(next), await nativeProbabilities.append(next)];
    }
  }, 120_000);

  it("is the same sequence after a second prefill (the cache is cleared), and refuses bad input", async () => {
    const prompt = await native.tokenize("Question: what is hypertension?\nAnswer:", { addBos: true });
    const first = await native.prefill(prompt);
    await native.append(argmax(first));
    const again = await native.prefill(prompt);
    expect(Buffer.from(again.buffer, again.byteOffset, again.byteLength)
      .equals(Buffer.from(first.buffer, first.byteOffset, first.byteLength))).toBe(true);
    await expect(native.append(native.vocabSize)).rejects.toThrow(/outside/);
    await expect(native.prefill([])).rejects.toThrow(/at least one token/);
  }, 120_000);

  it("refuses an addon built against the other library, and flash attention set on the Python build", async () => {
    const { path } = await embeddedGguf();
    const other = join(REPO, "js", "native", "build", "llama-cpp-python", "coveil_llama.node");
    await expect(LlamaCppNativeSLM.load(path, { addonPath: other })).rejects.toThrow(/built against llama-cpp-python, not node-llama-cpp/);
    await expect(LlamaCppNativeSLM.load(path, { llamaCpp: "llama-cpp-python", flashAttention: true })).rejects.toThrow(/flashAttention/);
  });

  it("says the addon is not built, naming the command, rather than loading another backend", async () => {
    const { path } = await embeddedGguf();
    const load = LlamaCppNativeSLM.load(path, { addonPath: "/nonexistent/coveil_llama.node" });
    await expect(load).rejects.toThrow(NativeAddonMissingError);
    await expect(load).rejects.toThrow(/npm run build:native/);
  });
});

describe("LlamaCppNativeSLM built against llama-cpp-python", () => {
  /** The Python SDK's logits (LlamaCppSLM) over a prefill of `ids` and `appends` greedy appends, one row each. */
  async function pythonRows(path: string, ids: readonly number[], appends: number, vocabSize: number): Promise<Float32Array[]> {
    const dir = mkdtempSync(join(tmpdir(), "coveil-rows-"));
    const out = join(dir, "rows.f32");
    let bytes: Buffer;
    try {
      await promisify(execFile)(PYTHON, [join(REPO, "js", "test", "e2e", "python_rows.py"), "--gguf", path, "--ids", ids.join(","),
        "--appends", String(appends), "--threads", "1", "--out", out], { cwd: REPO, env: { ...process.env, PYTHONPATH: REPO } });
      bytes = readFileSync(out);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
    const all = new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
    expect(all.length).toBe((appends + 1) * vocabSize);
    return Array.from({ length: appends + 1 }, (_, i) => all.subarray(i * vocabSize, (i + 1) * vocabSize));
  }

  const bytesOf = (row: Float32Array) => Buffer.from(row.buffer, row.byteOffset, row.byteLength);

  it("gives the Python SDK's logits bit for bit over a prefill and three appends (a short prompt and one cut in two decode calls)", async () => {
    const { path } = await embeddedGguf();
    const slm = await LlamaCppNativeSLM.load(path, { llamaCpp: "llama-cpp-python", threads: 1, rowKind: "logits" });
    try {
      const short = await slm.tokenize("Patient: 54-year-old with chest pain.\n\nQuestion: what test first?\nAnswer:", { addBos: true });
      const long = await slm.tokenize("Blood pressure 142/91 mmHg, heart rate 88, on lisinopril and metformin. ".repeat(24), { addBos: true });
      expect(long.length).toBeGreaterThan(256); // more than one n_batch: two llama_decode calls on each side
      for (const prompt of [short, long]) {
        const expected = await pythonRows(path, prompt, 3, slm.vocabSize);
        let row = await slm.prefill(prompt);
        for (let step = 0; step < expected.length; step++) {
          expect(bytesOf(row).equals(bytesOf(expected[step])), `prompt of ${prompt.length}, row ${step}`).toBe(true);
          if (step + 1 < expected.length) row = await slm.append(argmax(row));
        }
      }
    } finally {
      await slm.close();
    }
  }, 300_000);
});
