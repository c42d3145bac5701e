/**
 * The edge SLM on `node-llama-cpp` (Node and Electron): a GGUF model holding one sequence, returning the next
 * token's probabilities over the whole vocabulary at each step.
 *
 * `node-llama-cpp` hands out a step's row only as probabilities (its `controlledEvaluate` with
 * `generateNext.probabilities`: the softmax of the raw logits under a greedy sampler, in float32), never the raw
 * logits, so this backend's rows are probabilities (`rowKind`): probability-space policies run on it, a logit-space
 * policy is refused when the decoder is built.  (3.22 adds raw logits through the same kind of array, but the
 * registry had no macOS or Windows binaries of 3.22.1 when checked: `npm view @node-llama-cpp/mac-x64@3.22.1`, E404.)
 *
 * The row's path.  The public API gives the probabilities as a `Map` of 262,144 entries built from the addon's
 * flat `[id, p, id, p, ...]` array; the `Map` and laying it into a row cost about as much as the addon itself.  So
 * this backend reads the flat array where the addon hands it over (`rowPath === "addon"`): node-llama-cpp 3.21.1's
 * internal `LlamaContext._ctx.sampleToken(batchLogitIndex, sampler, probabilities)`, which resolves to
 * `[token, [id0, p0, id1, p1, ...], confidence]`.  package.json pins that version; `NodeLlamaCppSLM.load` checks
 * the shape and otherwise reads the public `Map` (`rowPath === "map"`: the same numbers, slower), and
 * test/e2e/nodeLlamaCpp.e2e.test.ts fails when the addon path is gone or its rows differ from the `Map`'s.
 *
 * Even so, the array costs about twice the decode (the SDK on this backend: 0.34-0.39 of raw node-llama-cpp's
 * tokens/s, bench/sdk_tokens.ts), and 3.21.1 offers no other whole row (no logits, no typed array): Node apps that
 * need the speed use `LlamaCppNativeSLM` (0.89-0.94 in the same runs).
 */

import { createHash } from "node:crypto";
import { availableParallelism } from "node:os";
import type { Llama, LlamaContext, LlamaContextSequence, LlamaModel, Token } from "node-llama-cpp";
import type { SLMBackend } from "./base.js";
import { InvalidArgumentError } from "../core/errors.js";
import { importPeer } from "../peer.js";

export interface NodeLlamaCppOptions {
  /** the model's name in the open (for the cloud's errors and logs; default: the file's name) */
  name?: string;
  /** context window in tokens (private context + public query + generation) */
  contextSize?: number;
  /** prompt tokens per decode call during prefill (the Python backend's n_batch: the same cut, the same numbers) */
  batchSize?: number;
  /** decode threads (default: the CPUs this process may use, at most 8, as the Python backend; node-llama-cpp's own
   * default can exceed them, and spinning threads on shared cores slowed a step 50-fold here) */
  threads?: number;
  /** an existing `getLlama()` instance (default: a CPU one, never building from source) */
  llama?: Llama;
  /** how a step's row is read (default `"addon"`, where node-llama-cpp has it; `"map"`: the public API) */
  rowPath?: RowPath;
}

/** A trailing run of these is the padding of a model's output matrix past its tokenizer. */
const PADDING_PIECE = /^\[PAD\d+\]$/;

/** How many of `tokens` the tokenizer has: all but a trailing run of padding pieces. */
export function unpaddedVocabSize(tokens: readonly string[]): number {
  let vocabSize = tokens.length;
  while (vocabSize && PADDING_PIECE.test(tokens[vocabSize - 1])) vocabSize--;
  return vocabSize;
}

/** Decode threads by default: the CPUs this process may use, at most 8 (as the Python backend). */
export function defaultThreads(): number {
  return Math.max(1, Math.min(8, availableParallelism()));
}

/** How a step's probabilities reach this backend (see the module's comment). */
export type RowPath = "addon" | "map";

/** node-llama-cpp 3.21.1's addon context, as far as the row's path reads it. */
interface AddonContext {
  sampleToken(batchLogitIndex: number, sampler: unknown, probabilities?: boolean, confidence?: boolean): Promise<unknown>;
}

/**
 * Route `context`'s probabilities past the public `Map`: its addon context `_ctx` is replaced by a proxy whose
 * `sampleToken`, asked for probabilities, hands the addon's flat `[id, p, ...]` array to `take` and returns none
 * (so node-llama-cpp builds no `Map`).  False, changing nothing, when `context` has no such `_ctx`.
 */
function captureFlatProbabilities(context: LlamaContext, take: (pairs: readonly number[]) => void): boolean {
  const internal = context as unknown as { _ctx?: AddonContext };
  const addon = internal._ctx;
  if (typeof addon?.sampleToken !== "function") return false;
  const sampleToken = async (index: number, sampler: unknown, probabilities?: boolean, confidence?: boolean) => {
    const result = await addon.sampleToken(index, sampler, probabilities, confidence);
    if (!probabilities || !Array.isArray(result) || !Array.isArray(result[1])) return result;
    take(result[1]);
    return [result[0], undefined, result[2]];
  };
  internal._ctx = new Proxy(addon, {
    get(target, key) {
      if (key === "sampleToken") return sampleToken;
      const value = Reflect.get(target, key);
      return typeof value === "function" ? value.bind(target) : value;
    },
  });
  return true;
}

export class NodeLlamaCppSLM implements SLMBackend {
  readonly rowKind = "probabilities" as const;
  private fingerprint: Uint8Array | null = null;
  /** the addon's flat `[id, p, ...]` array of the last evaluation that asked for probabilities (addon path) */
  private pairs: readonly number[] | null = null;
  private path: RowPath;

  private constructor(
    readonly name: string,
    readonly vocabSize: number,
    readonly eosTokenIds: ReadonlySet<number>,
    private readonly model: LlamaModel,
    private readonly context: LlamaContext,
    private readonly sequence: LlamaContextSequence,
    private readonly tokenStrings: readonly string[],
    rowPath: RowPath,
  ) {
    this.path = rowPath === "addon" && captureFlatProbabilities(context, (pairs) => { this.pairs = pairs; }) ? "addon" : "map";
  }

  /** How the rows are read: `"addon"` until an evaluation's row did not come that way, then `"map"`. */
  get rowPath(): RowPath {
    return this.path;
  }

  /** Load `modelPath` (a GGUF file). */
  static async load(modelPath: string, options: NodeLlamaCppOptions = {}): Promise<NodeLlamaCppSLM> {
    const { getLlama } = await importPeer("node-llama-cpp", "NodeLlamaCppSLM", () => import("node-llama-cpp"));
    const llama = options.llama ?? (await getLlama({ gpu: false, build: "never", logLevel: "error" as never }));
    const model = await llama.loadModel({ modelPath });
    const context = await model.createContext({
      contextSize: options.contextSize ?? 2048,
      batchSize: options.batchSize ?? 256,
      threads: options.threads ?? defaultThreads(),
    });
    const tokens = tokenStrings(model);
    const vocabSize = unpaddedVocabSize(tokens);
    const eos = new Set<number>();
    for (let id = 0; id < vocabSize; id++) if (model.isEogToken(id as Token)) eos.add(id);
    if (!eos.size && model.tokens.eos !== null) eos.add(model.tokens.eos);
    const name = options.name ?? modelPath.split(/[\\/]/).pop() ?? modelPath;
    return new NodeLlamaCppSLM(name, vocabSize, eos, model, context, context.getSequence(), tokens.slice(0, vocabSize),
      options.rowPath ?? "addon");
  }

  async tokenize(text: string, { addBos }: { addBos: boolean }): Promise<number[]> {
    const ids: number[] = this.model.tokenize(text, false);
    const bos = this.model.tokens.bos;
    return addBos && bos !== null && this.model.tokens.shouldPrependBosToken ? [bos, ...ids] : ids;
  }

  async detokenize(ids: readonly number[]): Promise<string> {
    return this.model.detokenize(ids as Token[], false);
  }

  async vocabFingerprint(): Promise<Uint8Array> {
    this.fingerprint ??= vocabFingerprint(this.tokenStrings);
    return this.fingerprint;
  }

  /** Make the sequence `ids`, evaluated from an empty cache (the result depends on `ids` alone). */
  async prefill(ids: readonly number[]): Promise<Float32Array> {
    if (!ids.length) throw new InvalidArgumentError("prefill needs at least one token");
    if (ids.length >= this.context.contextSize) {
      throw new InvalidArgumentError(`prompt of ${ids.length} tokens does not fit the context window n_ctx=${this.context.contextSize}`);
    }
    await this.sequence.clearHistory();
    return this.evaluate(ids as Token[]);
  }

  async append(tokenId: number): Promise<Float32Array> {
    if (!this.sequence.nextTokenIndex) throw new Error("append before prefill: the sequence is empty");
    if (this.sequence.nextTokenIndex + 1 >= this.context.contextSize) {
      throw new InvalidArgumentError(`the context window n_ctx=${this.context.contextSize} is full`);
    }
    return this.evaluate([tokenId as Token]);
  }

  /** Evaluate `ids` onto the sequence; the next token's probabilities by id. */
  private async evaluate(ids: Token[]): Promise<Float32Array> {
    const last = ids.length - 1;
    const input = ids.map((id, i) => (i === last ? ([id, { generateNext: { probabilities: true } }] as const) : id));
    this.pairs = null;
    const output = await this.sequence.controlledEvaluate(input as never);
    const row = new Float32Array(this.vocabSize);
    const pairs = this.pairs as readonly number[] | null;
    if (pairs !== null) {
      for (let j = 0; j < pairs.length; j += 2) if (pairs[j] < this.vocabSize) row[pairs[j]] = pairs[j + 1];
      this.pairs = null;
      return row;
    }
    this.path = "map";
    const probabilities = output[last]?.next?.probabilities;
    if (probabilities === undefined) throw new Error("node-llama-cpp returned no probabilities for the last position");
    for (const [id, p] of probabilities) if (id < this.vocabSize) row[id] = p;
    return row;
  }

  async close(): Promise<void> {
    await this.context.dispose();
    await this.model.dispose();
  }
}

/** sha256 over the token strings in id order, each UTF-8 and length-prefixed, U+2581 read as a space, then their
 * count (Python: `edge_sdk.models.vocab_fingerprint`): what the cloud checks the edge's vocabulary by. */
export function vocabFingerprint(tokens: readonly string[]): Uint8Array {
  const digest = createHash("sha256");
  const length = Buffer.alloc(4);
  for (const token of tokens) {
    const data = Buffer.from(token.replaceAll("\u2581", " "), "utf8");
    length.writeUInt32LE(data.length);
    digest.update(length);
    digest.update(data);
  }
  const count = Buffer.alloc(8);
  count.writeBigUInt64LE(BigInt(tokens.length));
  digest.update(count);
  return new Uint8Array(digest.digest());
}

/** Every tokenizer entry's string in id order, as the GGUF lists them (`tokenizer.ggml.tokens`). */
function tokenStrings(model: LlamaModel): readonly string[] {
  const metadata = model.fileInfo.metadata as { tokenizer?: { ggml?: { tokens?: readonly string[] } } };
  const tokens = metadata.tokenizer?.ggml?.tokens;
  if (!Array.isArray(tokens) || !tokens.length) throw new Error("the GGUF lists no tokenizer.ggml.tokens");
  return tokens;
}
