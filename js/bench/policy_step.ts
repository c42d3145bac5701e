/**
 * CoVeil's step in TypeScript as a multiple of one argmax pass over the same Float32Array, at a 262,144-token
 * vocabulary (Gemma-3's).  The package's size: bench/package_size.ts.
 *
 * Inputs are peaked distributions (softmax of Gaussian logits with a few boosted tokens), as the Python
 * benchmark (benchmarks/policy_step.py) draws them.  Each figure is the median of `--repeats` timed calls after
 * a warm-up, the three timed in turn in each round.  Usage (from js/): npm run bench [-- --repeats N]
 *
 * Every other registered policy's step is timed too (a table; CusText with its aggressive mapping: the
 * conservative one first builds clusters in ~V^2 d / size steps, minutes here at this vocabulary).
 *
 * The last lines are name=value: coveil_upload_vs_argmax and coveil_select_vs_argmax (target <= 10),
 * slowest_policy_vs_argmax.
 */

import { argmax, osDraws, softmax } from "../src/core/fusion.js";
import { CoVeil } from "../src/policies/coveil.js";
import { EmbeddingNeighbours } from "../src/policies/custext.js";
import { makePolicy, type Policy, registeredPolicies } from "../src/policies/index.js";

const VOCAB = 262_144;
const ALPHA = 0.3;

/** A seeded uniform generator (mulberry32) and standard normals from it (Box-Muller): inputs only. */
function normals(n: number, seed: number): Float32Array {
  let state = seed >>> 0;
  const uniform = (): number => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return (((t ^ (t >>> 14)) >>> 0) + 0.5) / 4294967296;
  };
  const out = new Float32Array(n);
  for (let i = 0; i < n; i++) out[i] = Math.sqrt(-2 * Math.log(uniform())) * Math.cos(2 * Math.PI * uniform());
  return out;
}

function peakedPair(vocab: number, seed: number): [Float32Array, Float32Array] {
  const zLlm = normals(vocab, seed).map((z) => 2 * z);
  const noise = normals(vocab, seed + 1);
  const zSlm = zLlm.map((z, i) => z + noise[i]);
  for (let j = 0; j < 5; j++) {
    zLlm[(seed * 7919 + j * 104729) % vocab] += 12;
    zSlm[(seed * 6007 + j * 130363) % vocab] += 12;
  }
  return [softmax(zSlm), softmax(zLlm)];
}

/**
 * Median seconds of each of `fns` over `repeats` rounds, after one warm-up call each; every round times each
 * function once, in turn, so a load that comes and goes on a shared machine weighs on all of them alike.
 */
function medianSeconds(fns: (() => unknown)[], repeats: number): number[] {
  fns.forEach((fn) => fn());
  const samples: number[][] = fns.map(() => []);
  for (let r = 0; r < repeats; r++) {
    fns.forEach((fn, f) => {
      const start = process.hrtime.bigint();
      fn();
      samples[f].push(Number(process.hrtime.bigint() - start) / 1e9);
    });
  }
  return samples.map((list) => list.sort((a, b) => a - b)[Math.floor(list.length / 2)]);
}

function main(): void {
  const at = process.argv.indexOf("--repeats");
  const repeats = at >= 0 ? Number(process.argv[at + 1]) : 100;
  const [pSlm, pLlm] = peakedPair(VOCAB, 262_144);
  const coveil = new CoVeil();
  const [floor, upload, select] = medianSeconds([
    () => argmax(pLlm),
    () => coveil.decide("cloud", pSlm, pLlm, ALPHA),
    () => coveil.decide("edge", pSlm, pLlm, ALPHA),
  ], repeats);
  const table: [string, string, number][] = [];
  for (const name of registeredPolicies()) {
    if (name === "coveil") continue;
    const policy: Policy = name === "custext"
      ? makePolicy(name, { neighbours: new EmbeddingNeighbours(normals(VOCAB * 64, 7), VOCAB, 64), mapping: "aggressive" })
      : makePolicy(name);
    for (const mode of [...policy.modes].sort()) {
      const [base, step] = medianSeconds([() => argmax(pLlm), () => policy.decide(mode, pSlm, pLlm, ALPHA, osDraws)],
        Math.max(5, Math.floor(repeats / 10)));
      table.push([name, mode, step / base]);
    }
  }
  console.log(`vocab ${VOCAB.toLocaleString("en-US")}: argmax = ${(floor * 1e6).toFixed(1)} us`);
  console.log(`  coveil cloud (upload): ${(upload * 1e6).toFixed(1)} us`);
  console.log(`  coveil edge (select):  ${(select * 1e6).toFixed(1)} us`);
  for (const [name, mode, ratio] of table) console.log(`  ${name.padEnd(14)}${mode.padEnd(7)}${ratio.toFixed(1)}x argmax`);
  console.log(`coveil_upload_vs_argmax=${(upload / floor).toFixed(2)}`);
  console.log(`coveil_select_vs_argmax=${(select / floor).toFixed(2)}`);
  const slowest = Math.max(upload / floor, select / floor, ...table.map(([, , ratio]) => ratio));
  console.log(`slowest_policy_vs_argmax=${slowest.toFixed(2)}`);
}

main();
