/**
 * The narrow interface the decoding loop needs from an edge language model (Python:
 * `edge_sdk.backends.base.SLMBackend`): a causal LM holding one sequence that returns the next token's row over the
 * whole vocabulary.  A `llama.rn` (React Native), `node-llama-cpp` or `wllama` model plugs in by implementing it.
 */

export interface SLMBackend {
  readonly name: string;
  /** the shared tokenizer's ids (rows are this long) */
  readonly vocabSize: number;
  readonly eosTokenIds: ReadonlySet<number>;
  /**
   * What a row holds: the model's raw `"logits"`, or its next-token `"probabilities"` (softmax of the logits: all a
   * runtime that hands out only probabilities can give).  Probability-space policies read both alike; a
   * logit-space policy needs raw logits and is refused at construction without them.
   */
  readonly rowKind: "logits" | "probabilities";
  tokenize(text: string, options: { addBos: boolean }): Promise<number[]>;
  detokenize(ids: readonly number[]): Promise<string>;
  /** sha256 over the token strings in id order (the cloud checks it against its own) */
  vocabFingerprint(): Promise<Uint8Array>;
  /**
   * Make the sequence `ids` (the result depends on `ids` alone); the next token's row.  The row is a fresh array
   * the caller then owns: the backend neither keeps nor hands out another view of its memory, since the decoder
   * masks a probability row in place rather than copying a megabyte a step.
   */
  prefill(ids: readonly number[]): Promise<Float32Array>;
  /** Extend the sequence by `tokenId`; the next token's row, a fresh array the caller owns (as `prefill`). */
  append(tokenId: number): Promise<Float32Array>;
}
