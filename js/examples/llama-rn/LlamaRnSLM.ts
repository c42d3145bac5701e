/**
 * A `llama.rn` (React Native) SLM backend: the `SLMBackend` interface over llama.rn's public calls, in the few lines
 * docs/guides/typescript.md shows.  React Native is not installed here, so this compiles (`npm run typecheck`,
 * against `llama.rn.d.ts`, a declaration of the calls it makes) but has not run.
 *
 * llama.rn hands out a step's row only through `completion`: with `n_probs` set to the vocabulary's size and
 * `post_sampling_probs: false`, the first generated token's candidates are the softmax of the raw logits over
 * every id, so the rows are probabilities (`rowKind`).  Its prompt is text: the backend keeps the sequence's ids,
 * sends their text, and refuses a text that does not tokenise back to the same ids (a different prompt would be a
 * different row).  llama.rn keeps the prompt's common prefix in its cache, so a step evaluates the new token.
 */

import type { LlamaContext } from "llama.rn";
import type { SLMBackend } from "../../src/index.js";

export class LlamaRnSLM implements SLMBackend {
  readonly rowKind = "probabilities";
  private ids: number[] = [];

  /** `fingerprint`: the vocabulary's sha256 (`vocabFingerprint` in Node), shipped with the model. */
  constructor(private readonly ctx: LlamaContext, readonly name: string, readonly vocabSize: number,
    readonly eosTokenIds: ReadonlySet<number>, private readonly bosTokenId: number, private readonly fingerprint: Uint8Array) {}

  async tokenize(text: string, { addBos }: { addBos: boolean }): Promise<number[]> {
    const { tokens } = await this.ctx.tokenize(text);
    const bare = tokens[0] === this.bosTokenId ? tokens.slice(1) : tokens;
    return addBos ? [this.bosTokenId, ...bare] : bare;
  }

  detokenize(ids: readonly number[]): Promise<string> {
    return this.ctx.detokenize([...ids]);
  }

  async vocabFingerprint(): Promise<Uint8Array> {
    return this.fingerprint;
  }

  prefill(ids: readonly number[]): Promise<Float32Array> {
    if (!ids.length) throw new RangeError("prefill needs at least one token");
    this.ids = [...ids];
    return this.row();
  }

  append(tokenId: number): Promise<Float32Array> {
    if (!this.ids.length) throw new Error("append before prefill: the sequence is empty");
    this.ids.push(tokenId);
    return this.row();
  }

  /** The next token's probabilities after the sequence, over the whole vocabulary. */
  private async row(): Promise<Float32Array> {
    const bare = this.ids[0] === this.bosTokenId ? this.ids.slice(1) : this.ids;
    const prompt = await this.ctx.detokenize(bare);
    if (String(await this.tokenize(prompt, { addBos: this.ids[0] === this.bosTokenId })) !== String(this.ids)) {
      throw new Error("the sequence's text does not tokenise back to its ids: llama.rn's prompt would differ");
    }
    const result = await this.ctx.completion({ prompt, n_predict: 1, n_probs: this.vocabSize, post_sampling_probs: false, temperature: 0 });
    const candidates = result.completion_probabilities?.[0]?.probs ?? [];
    if (candidates.length < this.vocabSize) {
      throw new Error(`llama.rn gave ${candidates.length} of ${this.vocabSize} ids' probabilities: this build cuts n_probs`);
    }
    const row = new Float32Array(this.vocabSize);
    for (const { tok_id, prob } of candidates) if (tok_id < this.vocabSize) row[tok_id] = prob;
    return row;
  }
}
