/**
 * NodeLlamaCppSLM on the embedded GGUF: its rows come through the addon's flat `[id, p, ...]` array (node-llama-cpp
 * 3.21.1's internal `LlamaContext._ctx.sampleToken`, pinned in package.json), and they are the public API's `Map`
 * row bit for bit.  This fails when a node-llama-cpp update removes or reshapes that internal.
 */

import { getLlama, type Llama } from "node-llama-cpp";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { NodeLlamaCppSLM } from "../../src/backends/nodeLlamaCpp.js";
import { argmax } from "../../src/core/fusion.js";
import { embeddedGguf } from "./adapter.js";

let llama: Llama;
let addon: NodeLlamaCppSLM;
let map: NodeLlamaCppSLM;

beforeAll(async () => {
  llama = await getLlama({ gpu: false, build: "never", logLevel: "error" as never });
  const { path } = await embeddedGguf();
  addon = await NodeLlamaCppSLM.load(path, { llama, threads: 1 });
  map = await NodeLlamaCppSLM.load(path, { llama, threads: 1, rowPath: "map" });
}, 120_000);

afterAll(async () => {
  await addon?.close();
  await map?.close();
});

describe("NodeLlamaCppSLM's rows", () => {
  it("come through the addon's flat array, equal to the public Map's bit for bit, over a prefill and three appends", async () => {
    expect(addon.rowPath).toBe("addon");
    expect(map.rowPath).toBe("map");
    const prompt = await addon.tokenize("The patient was admitted with chest pain and", { addBos: true });
    let fast = await addon.prefill(prompt);
    let slow = await map.prefill(prompt);
    for (let step = 0; ; step++) {
      expect(fast.length).toBe(addon.vocabSize);
      expect(Buffer.from(fast.buffer).equals(Buffer.from(slow.buffer)), `row ${step}`).toBe(true);
      // a distribution over the whole vocabulary: every id has a value, and they sum to 1
      expect(fast.every((p) => p > 0)).toBe(true);
      expect(Math.abs(fast.reduce((sum, p) => sum + p, 0) - 1)).toBeLessThan(1e-3);
      if (step === 3) break;
      const next = argmax(fast);
      [fast, slow] = [await addon.append(next), await map.append(next)];
    }
    expect(addon.rowPath).toBe("addon"); // every row came the fast way
  }, 120_000);
});
