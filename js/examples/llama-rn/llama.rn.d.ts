/**
 * A TYPE DECLARATION, not an implementation: the few calls of `llama.rn` (React Native's llama.cpp binding) that
 * `LlamaRnSLM.ts` makes, with the shapes llama.rn's `src/index.ts` and `src/types.ts` give them, so that the example
 * typechecks here (`npm run typecheck`), where React Native and llama.rn are not installed.  Nothing here runs:
 * in an app, `import ... from "llama.rn"` resolves to the real package and this file is not part of the build.
 */

declare module "llama.rn" {
  /** One candidate of a generated token's distribution (`NativeCompletionTokenProbItem`). */
  export interface NativeCompletionTokenProbItem {
    tok_id: number;
    tok_str: string;
    prob: number;
  }

  /** A generated token and its `n_probs` most probable candidates (`NativeCompletionTokenProb`). */
  export interface NativeCompletionTokenProb {
    content: string;
    probs: NativeCompletionTokenProbItem[];
  }

  /** The completion's parameters this example sets (a subset of `NativeCompletionParams`). */
  export interface CompletionParams {
    prompt: string;
    /** tokens to generate */
    n_predict?: number;
    /** > 0: each generated token's `n_probs` most probable candidates */
    n_probs?: number;
    /** false: `n_probs` reports the softmax of the raw logits, ignoring every sampler setting */
    post_sampling_probs?: boolean;
    temperature?: number;
  }

  /** The completion's result, as far as this example reads it (a subset of `NativeCompletionResult`). */
  export interface NativeCompletionResult {
    text: string;
    tokens_predicted: number;
    completion_probabilities?: NativeCompletionTokenProb[];
  }

  export interface NativeTokenizeResult {
    tokens: number[];
  }

  export class LlamaContext {
    tokenize(text: string, options?: { media_paths?: string[] }): Promise<NativeTokenizeResult>;
    detokenize(tokens: number[]): Promise<string>;
    completion(params: CompletionParams): Promise<NativeCompletionResult>;
  }
}
