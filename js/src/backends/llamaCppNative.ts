/**
 * The edge SLM on llama.cpp through the SDK's own small Node-API addon (`native/coveil_llama.c`, built by
 * `npm run build:native`): a GGUF model holding one sequence, returning the next token's row over the whole
 * vocabulary at each step as a `Float32Array`: its probabilities (`rowKind: "probabilities"`, the default: the
 * softmax computed in the addon, off the JS thread, as the SDK's own `softmax` computes it) or its raw logits
 * (`rowKind: "logits"`, for logit-space policies; the SDK then takes the softmax where a policy needs it).
 *
 * Why beside `NodeLlamaCppSLM`: node-llama-cpp 3.21 hands a step's row out only as probabilities its addon sorts
 * over all 262,144 ids and lays into a plain JS array element by element, which costs about twice the decode; this
 * addon calls the same library (node-llama-cpp's prebuilt `libllama`, linked with an rpath to its folder) with the
 * same context settings, so its logits are the ones node-llama-cpp's probabilities are the softmax of, and its
 * probabilities the SDK's softmax of those logits bit for bit (test/e2e/llamaCppNative.e2e.test.ts).
 *
 * `llamaCpp: "llama-cpp-python"` loads the same addon built against the llama.cpp the Python SDK runs
 * (`npm run build:native -- --llama llama-cpp-python`: llama-cpp-python's headers and `libllama`) and makes the
 * context as the Python SDK's `LlamaCppSLM` makes it, so its logits are the Python SDK's bit for bit
 * (test/e2e/llamaCppNative.e2e.test.ts), and cloud-side uploads are the Python SDK's bytes.
 *
 * Node on Linux x64 only (the addon links node-llama-cpp's linux-x64 binaries); loading fails with
 * `NativeAddonMissingError` when the addon is not built or the library is gone, never falling back to another backend.
 */

import { readFileSync, existsSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { InvalidArgumentError } from "../core/errors.js";
import type { SLMBackend } from "./base.js";
import { defaultThreads, unpaddedVocabSize, vocabFingerprint } from "./nodeLlamaCpp.js";

/** The llama.cpp library an addon build links, and whose context settings it takes. */
export type NativeLlamaCpp = "node-llama-cpp" | "llama-cpp-python";
const LIBRARIES: readonly NativeLlamaCpp[] = ["node-llama-cpp", "llama-cpp-python"];

export interface LlamaCppNativeOptions {
  /**
   * which build of the addon (default `"node-llama-cpp"`: node-llama-cpp's library, its context settings and its
   * numbers); `"llama-cpp-python"`: llama-cpp-python's library with the Python SDK's `LlamaCppSLM` context settings
   * (llama.cpp's defaults but `n_ctx`, `n_batch = n_ubatch` and the threads), the Python SDK's numbers
   */
  llamaCpp?: NativeLlamaCpp;
  /** the model's name in the open (default: the file's name) */
  name?: string;
  /** context window in tokens (private context + public query + generation) */
  contextSize?: number;
  /** prompt tokens per decode call during prefill (node-llama-cpp's batchSize: the same cut, the same numbers) */
  batchSize?: number;
  /** decode threads (default: the CPUs this process may use, at most 8, as the other backends) */
  threads?: number;
  /**
   * flash attention (default on: what node-llama-cpp 3.21 resolves its "auto" to on the CPU, and its numbers);
   * not settable with `llamaCpp: "llama-cpp-python"` (llama.cpp's default, as the Python SDK leaves it)
   */
  flashAttention?: boolean;
  /** what a row holds (default `"probabilities"`; `"logits"` for a logit-space policy) */
  rowKind?: "logits" | "probabilities";
  /** the built addon (default: `native/build/<llamaCpp>/coveil_llama.node` in this package) */
  addonPath?: string;
}

/** The addon is not built, or the llama.cpp library it links is missing. */
export class NativeAddonMissingError extends Error {
  override name = "NativeAddonMissingError";
}

/** native/coveil_llama.c's exports (see its header comment). */
interface Addon {
  load(libDir: string, modelPath: string, contextSize: number, batchSize: number, threads: number, flashAttention: boolean,
    settings: NativeLlamaCpp): Handle;
  info(handle: Handle): { vocabSize: number; bos: number; addBos: boolean; eog: number[]; contextSize: number; batchSize: number };
  tokenTexts(handle: Handle): string[];
  tokenize(handle: Handle, text: string): Int32Array;
  detokenize(handle: Handle, ids: Int32Array): string;
  clear(handle: Handle): void;
  decode(handle: Handle, ids: Int32Array, softmaxOver: number): Promise<Float32Array>;
  free(handle: Handle): void;
}
type Handle = { readonly __coveilLlama: unique symbol };

/** This package's root: the nearest folder above this module holding `native/build.mjs`. */
function packageRoot(): string {
  let dir = dirname(fileURLToPath(import.meta.url));
  while (!existsSync(join(dir, "native", "build.mjs"))) {
    const parent = dirname(dir);
    if (parent === dir) throw new NativeAddonMissingError("cannot find @coveil/edge's native/ folder above " + fileURLToPath(import.meta.url));
    dir = parent;
  }
  return dir;
}

/** The built addon and the library folder it was linked against, or `NativeAddonMissingError` saying what is missing. */
function loadAddon(library: NativeLlamaCpp, addonPath?: string): { addon: Addon; libDir: string } {
  const path = addonPath ?? join(packageRoot(), "native", "build", library, "coveil_llama.node");
  const howToBuild = library === "node-llama-cpp"
    ? "build it with `npm run build:native` in @coveil/edge (Linux x64, gcc, git and node-llama-cpp installed)"
    : "build it with `npm run build:native -- --llama llama-cpp-python` in @coveil/edge (Linux x64, gcc, the Python with llama-cpp-python)";
  if (!existsSync(path)) throw new NativeAddonMissingError(`the native llama.cpp addon is not built (${path} is missing): ${howToBuild}`);
  const buildInfo = join(dirname(path), "build.json");
  if (!existsSync(buildInfo)) throw new NativeAddonMissingError(`${buildInfo} is missing: ${howToBuild}`);
  const built = JSON.parse(readFileSync(buildInfo, "utf8")) as { libDir: string; library?: string };
  if (built.library !== library) {
    throw new NativeAddonMissingError(`${path} is built against ${built.library ?? "an unnamed library"}, not ${library}: ${howToBuild}`);
  }
  const { libDir } = built;
  if (!existsSync(libDir)) {
    throw new NativeAddonMissingError(`the llama.cpp library the addon was built against is gone (${libDir}): ${howToBuild} again`);
  }
  try {
    return { addon: createRequire(import.meta.url)(path) as Addon, libDir };
  } catch (error) {
    throw new NativeAddonMissingError(`the native llama.cpp addon at ${path} does not load (${(error as Error).message}): ${howToBuild} again`);
  }
}

export class LlamaCppNativeSLM implements SLMBackend {
  private fingerprint: Uint8Array | null = null;
  /** the sequence's length */
  private length = 0;

  private constructor(
    readonly name: string,
    readonly vocabSize: number,
    readonly eosTokenIds: ReadonlySet<number>,
    private readonly addon: Addon,
    private readonly handle: Handle,
    private readonly bos: number | null,
    readonly contextSize: number,
    private readonly tokenTexts: readonly string[],
    readonly rowKind: "logits" | "probabilities",
  ) {}

  /** Load `modelPath` (a GGUF file); `NativeAddonMissingError` when the addon is not built. */
  static async load(modelPath: string, options: LlamaCppNativeOptions = {}): Promise<LlamaCppNativeSLM> {
    const rowKind = options.rowKind ?? "probabilities";
    if (rowKind !== "logits" && rowKind !== "probabilities") throw new InvalidArgumentError(`rowKind must be "logits" or "probabilities", got ${rowKind}`);
    const library = options.llamaCpp ?? "node-llama-cpp";
    if (!LIBRARIES.includes(library)) throw new InvalidArgumentError(`llamaCpp must be one of ${LIBRARIES.join(", ")}, got ${library}`);
    if (library === "llama-cpp-python" && options.flashAttention !== undefined) {
      throw new InvalidArgumentError("flashAttention: not settable with llamaCpp \"llama-cpp-python\" (the Python SDK leaves llama.cpp's default)");
    }
    const { addon, libDir } = loadAddon(library, options.addonPath);
    if (!existsSync(modelPath)) throw new InvalidArgumentError(`modelPath: no such file ${modelPath}`);
    const handle = addon.load(libDir, modelPath, options.contextSize ?? 2048, options.batchSize ?? 256,
      options.threads ?? defaultThreads(), options.flashAttention ?? true, library);
    const info = addon.info(handle);
    const texts = addon.tokenTexts(handle);
    const vocabSize = unpaddedVocabSize(texts);
    const eos = new Set(info.eog.filter((id) => id < vocabSize));
    const name = options.name ?? modelPath.split(/[\\/]/).pop() ?? modelPath;
    return new LlamaCppNativeSLM(name, vocabSize, eos, addon, handle, info.addBos && info.bos >= 0 ? info.bos : null,
      info.contextSize, texts.slice(0, vocabSize), rowKind);
  }

  async tokenize(text: string, { addBos }: { addBos: boolean }): Promise<number[]> {
    const ids = Array.from(this.addon.tokenize(this.handle, text));
    return addBos && this.bos !== null ? [this.bos, ...ids] : ids;
  }

  async detokenize(ids: readonly number[]): Promise<string> {
    return this.addon.detokenize(this.handle, Int32Array.from(ids));
  }

  async vocabFingerprint(): Promise<Uint8Array> {
    this.fingerprint ??= vocabFingerprint(this.tokenTexts);
    return this.fingerprint;
  }

  /** Make the sequence `ids`, evaluated from an empty cache (the result depends on `ids` alone). */
  async prefill(ids: readonly number[]): Promise<Float32Array> {
    if (!ids.length) throw new InvalidArgumentError("prefill needs at least one token");
    if (ids.length >= this.contextSize) {
      throw new InvalidArgumentError(`prompt of ${ids.length} tokens does not fit the context window n_ctx=${this.contextSize}`);
    }
    this.addon.clear(this.handle);
    this.length = 0;
    return this.evaluate(ids);
  }

  async append(tokenId: number): Promise<Float32Array> {
    if (!this.length) throw new Error("append before prefill: the sequence is empty");
    if (this.length + 1 >= this.contextSize) throw new InvalidArgumentError(`the context window n_ctx=${this.contextSize} is full`);
    return this.evaluate([tokenId]);
  }

  /** Decode `ids` onto the sequence; the last one's row over the tokenizer's ids. */
  private async evaluate(ids: readonly number[]): Promise<Float32Array> {
    for (const id of ids) {
      if (!Number.isInteger(id) || id < 0 || id >= this.vocabSize) throw new InvalidArgumentError(`token id ${id} is outside [0, ${this.vocabSize})`);
    }
    const row = await this.addon.decode(this.handle, Int32Array.from(ids),
      this.rowKind === "probabilities" ? this.vocabSize : 0);
    this.length += ids.length;
    return row.length === this.vocabSize ? row : row.subarray(0, this.vocabSize);
  }

  async close(): Promise<void> {
    this.addon.free(this.handle);
  }
}
