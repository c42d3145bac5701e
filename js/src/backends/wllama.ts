/**
 * The edge SLM on `wllama` (llama.cpp in WebAssembly: a browser or a WebView): a GGUF model holding one sequence,
 * returning the next token's probabilities over the whole vocabulary at each step (`getLogits(-1)`: the softmax of
 * the raw logits; wllama hands out no raw logits, so a logit-space policy is refused with it, as with
 * node-llama-cpp).
 */

import type { Wllama } from "@wllama/wllama/esm/wllama.js"; // its index re-exports without extensions
import type { SLMBackend } from "./base.js";
import { InvalidArgumentError } from "../core/errors.js";

export interface WllamaOptions {
  /** the model's name in the open (for the cloud's errors and logs) */
  name: string;
  /**
   * sha256 of the vocabulary as the Python SDK computes it (`edge_sdk.models.vocab_fingerprint`: the GGUF's token
   * strings): public, shipped with the model; wllama exposes the tokens' pieces, not those strings.
   */
  vocabFingerprint: Uint8Array;
}

export class WllamaSLM implements SLMBackend {
  readonly rowKind = "probabilities" as const;
  readonly name: string;
  readonly vocabSize: number;
  readonly eosTokenIds: ReadonlySet<number>;
  private length = 0;

  /** `wllama`: a loaded model (`loadModel`/`loadModelFromUrl` done). */
  constructor(private readonly wllama: Wllama, private readonly options: WllamaOptions) {
    this.name = options.name;
    this.vocabSize = wllama.getModelMetadata().hparams.nVocab;
    const eos = new Set<number>();
    for (let id = 0; id < this.vocabSize; id++) if (wllama.isTokenEOG(id)) eos.add(id);
    this.eosTokenIds = eos;
  }

  async tokenize(text: string, { addBos }: { addBos: boolean }): Promise<number[]> {
    const ids = await this.wllama.tokenize(text, false);
    return addBos && this.wllama.mustAddBosToken() ? [this.wllama.getBOS(), ...ids] : ids;
  }

  async detokenize(ids: readonly number[]): Promise<string> {
    return this.wllama.detokenize([...ids], true);
  }

  async vocabFingerprint(): Promise<Uint8Array> {
    return this.options.vocabFingerprint;
  }

  /** Make the sequence `ids`, from an empty cache. */
  async prefill(ids: readonly number[]): Promise<Float32Array> {
    if (!ids.length) throw new InvalidArgumentError("prefill needs at least one token");
    await this.wllama.kvClear();
    this.length = ids.length;
    await this.wllama.decode([...ids], {});
    return this.row();
  }

  async append(tokenId: number): Promise<Float32Array> {
    if (!this.length) throw new Error("append before prefill: the sequence is empty");
    this.length++;
    await this.wllama.decode([tokenId], {});
    return this.row();
  }

  private async row(): Promise<Float32Array> {
    const row = new Float32Array(this.vocabSize);
    for (const { token, p } of await this.wllama.getLogits(-1)) if (token < this.vocabSize) row[token] = p;
    return row;
  }
}
