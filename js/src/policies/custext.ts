/**
 * CusText, edge-side: the fused argmax replaced through the exponential mechanism over an output set of similar
 * tokens (Python: `edge_sdk.policies.custext`).  The similarities are cosines of the model's token embeddings,
 * computed here in float64 and rounded to float32 (Python's are BLAS float32 products), so a similarity can differ
 * from Python's in its last bits.
 */

import {
  argmax, checkAlpha, type Draws, FLOAT32_TINY, fuse, sampleFrom, sumFloat32, sumFloat64, topKIds,
} from "../core/fusion.js";
import { InvalidArgumentError } from "../core/errors.js";
import { ReleaseEvent } from "../privacy/accountant.js";
import { checkEpsilon, checkPositiveInt } from "../privacy/accounting.js";
import { type Described, type FusionMode, Policy, requireDraws, SyncedToken } from "./base.js";

export type CusTextMapping = "conservative" | "aggressive";
export const CUSTEXT_MAPPINGS: readonly CusTextMapping[] = ["conservative", "aggressive"];

const f32 = Math.fround;

/**
 * A partition of the vocabulary into clusters of (at most) `size` tokens, built greedily: ids visited in
 * increasing order; an id not yet in a cluster opens one with itself and its `size - 1` most similar ids not yet
 * in any cluster (ties to the lower id).  About `V^2 d / size` multiply-adds.
 */
export class TokenClusters {
  private readonly label: Int32Array;
  private readonly members: number[][] = [];

  constructor(neighbours: EmbeddingNeighbours, readonly size: number) {
    checkPositiveInt(size, "cluster size");
    const vocab = neighbours.vocabSize;
    this.label = new Int32Array(vocab).fill(-1);
    const row = new Float32Array(vocab);
    for (let anchor = 0; anchor < vocab; anchor++) {
      if (this.label[anchor] >= 0) continue;
      neighbours.similaritiesInto(anchor, row);
      for (let id = 0; id < vocab; id++) if (this.label[id] >= 0) row[id] = -Infinity;
      row[anchor] = Infinity; // the anchor opens its own cluster
      const chosen = topKIds(row, size).filter((id) => row[id] > -Infinity);
      for (const id of chosen) this.label[id] = this.members.length;
      this.members.push(chosen.sort((x, y) => x - y));
    }
  }

  get length(): number {
    return this.members.length;
  }

  /** The ids of `tokenId`'s cluster (ascending, `tokenId` included). */
  of(tokenId: number): number[] {
    return this.members[this.label[tokenId]];
  }
}

/** Nearest tokens by cosine similarity of token-embedding rows (normalised once, kept in float32). */
export class EmbeddingNeighbours {
  readonly vocabSize: number;
  readonly dim: number;
  private readonly unit: Float32Array;
  private readonly clusterCache = new Map<number, TokenClusters>();
  private readonly cache = new Map<number, { ids: number[]; similarities: Float32Array }>();

  /** `embeddings`: a `[vocabSize, dim]` matrix, row after row. */
  constructor(embeddings: Float32Array, vocabSize: number, dim: number, readonly cacheSize = 4096) {
    checkPositiveInt(cacheSize, "neighbour cache size");
    if (!(vocabSize > 0 && dim > 0) || embeddings.length !== vocabSize * dim) {
      throw new InvalidArgumentError(
        `embeddings must be a non-empty 2-D float array [V, d], got ${embeddings.length} values for [${vocabSize}, ${dim}]`,
      );
    }
    this.vocabSize = vocabSize;
    this.dim = dim;
    this.unit = new Float32Array(embeddings.length);
    const squares = new Float32Array(dim);
    for (let r = 0; r < vocabSize; r++) {
      for (let c = 0; c < dim; c++) squares[c] = embeddings[r * dim + c] * embeddings[r * dim + c];
      const norm = Math.max(f32(Math.sqrt(sumFloat32(squares))), FLOAT32_TINY); // numpy's float32 norm
      for (let c = 0; c < dim; c++) this.unit[r * dim + c] = embeddings[r * dim + c] / norm;
    }
  }

  describe(): string {
    return `EmbeddingNeighbours(vocab_size=${this.vocabSize}, dim=${this.dim})`;
  }

  private checkId(tokenId: number): number {
    if (!(Number.isInteger(tokenId) && tokenId >= 0 && tokenId < this.vocabSize)) {
      throw new InvalidArgumentError(`token id ${tokenId} is outside the embedding vocabulary [0, ${this.vocabSize})`);
    }
    return tokenId;
  }

  /** Cosine similarity of `tokenId`'s row to the rows `ids` (float32). */
  similarities(tokenId: number, ids: ArrayLike<number>): Float32Array {
    const query = this.checkId(tokenId) * this.dim;
    return Float32Array.from(Array.from(ids), (id) => {
      let sum = 0;
      for (let c = 0; c < this.dim; c++) sum += this.unit[id * this.dim + c] * this.unit[query + c];
      return sum;
    });
  }

  /** Cosine similarity of `tokenId`'s row to every row, into `out`. */
  similaritiesInto(tokenId: number, out: Float32Array): Float32Array {
    const { unit, dim, vocabSize } = this;
    const query = unit.slice(this.checkId(tokenId) * dim, (tokenId + 1) * dim);
    for (let id = 0, row = 0; id < vocabSize; id++, row += dim) {
      let sum = 0;
      for (let c = 0; c < dim; c++) sum += unit[row + c] * query[c];
      out[id] = sum;
    }
    return out;
  }

  /**
   * The `n` most similar tokens to `tokenId` (itself included), by decreasing similarity, and their similarities;
   * remembered for up to `cacheSize` token ids (oldest evicted first), as Python's: a smaller `n` is a prefix of a
   * larger one.
   */
  of(tokenId: number, n: number): { ids: number[]; similarities: Float32Array } {
    checkPositiveInt(n, "neighbour count n");
    let cached = this.cache.get(tokenId);
    if (cached === undefined || cached.ids.length < Math.min(n, this.vocabSize)) {
      const all = this.similaritiesInto(tokenId, new Float32Array(this.vocabSize));
      const ids = topKIds(all, n);
      cached = { ids, similarities: Float32Array.from(ids, (id) => all[id]) };
      this.cache.delete(tokenId);
      if (this.cache.size >= this.cacheSize) this.cache.delete(this.cache.keys().next().value as number);
      this.cache.set(tokenId, cached);
    }
    return { ids: cached.ids.slice(0, n), similarities: cached.similarities.slice(0, n) };
  }

  /** The conservative mapping's partition into clusters of `size` (built on first use, then kept). */
  clusters(size: number): TokenClusters {
    let clusters = this.clusterCache.get(size);
    if (clusters === undefined) {
      clusters = new TokenClusters(this, size);
      this.clusterCache.set(size, clusters);
    }
    return clusters;
  }
}

/**
 * The exponential mechanism over an output set: `u = (sim - min sim) / (max sim - min sim)` and
 * `Pr[y] = exp(eps * u(y) / 2) / sum_y' exp(eps * u(y') / 2)` (uniform when every similarity is equal).
 */
export function custextProbabilities(similarities: ArrayLike<number>, epsilon: number): Float64Array {
  checkEpsilon(epsilon);
  if (similarities.length === 0) throw new InvalidArgumentError("similarities must be a non-empty 1-D array");
  let low = Infinity;
  let high = -Infinity;
  for (let i = 0; i < similarities.length; i++) {
    low = Math.min(low, similarities[i]);
    high = Math.max(high, similarities[i]);
  }
  const span = high - low;
  const weights = Float64Array.from(Array.from(similarities), (s) =>
    Math.exp(0.5 * epsilon * ((span > 0 ? (s - low) / span : 0) - 1)));
  const total = sumFloat64(weights);
  return weights.map((w) => w / total);
}

/** `[ids, similarities to tokenId]` of `tokenId`'s output set: its cluster, or its `n` nearest tokens. */
export function custextOutputSet(tokenId: number, neighbours: EmbeddingNeighbours, nNeighbours: number,
  mapping: CusTextMapping): { ids: number[]; similarities: Float32Array } {
  if (mapping === "aggressive") return neighbours.of(tokenId, nNeighbours);
  if (mapping !== "conservative") {
    throw new InvalidArgumentError(`CusText mapping must be one of ('conservative', 'aggressive'), got '${mapping as string}'`);
  }
  const ids = neighbours.clusters(nNeighbours).of(tokenId);
  return { ids, similarities: neighbours.similarities(tokenId, ids) };
}

/** CusText, edge-side: `y = argmax p_fuse`, then a draw from `y`'s output set; `epsilon` is one token's. */
export class CusText extends Policy {
  readonly name = "custext";
  readonly modes: ReadonlySet<FusionMode> = new Set<FusionMode>(["edge"]);
  readonly neighbours: EmbeddingNeighbours;
  readonly epsilon: number;
  readonly nNeighbours: number;
  readonly mapping: CusTextMapping;

  constructor(params: { neighbours?: EmbeddingNeighbours; epsilon?: number; n_neighbours?: number;
    mapping?: CusTextMapping } = {}) {
    super();
    if (!(params.neighbours instanceof EmbeddingNeighbours)) {
      throw new InvalidArgumentError(
        "CusText needs neighbours=EmbeddingNeighbours(embeddings, vocabSize, dim): the edge model's token embeddings");
    }
    this.neighbours = params.neighbours;
    this.epsilon = checkEpsilon(params.epsilon ?? 5.0);
    this.nNeighbours = checkPositiveInt(params.n_neighbours ?? 20, "CusText neighbour count n_neighbours");
    this.mapping = params.mapping ?? "conservative";
    if (!CUSTEXT_MAPPINGS.includes(this.mapping)) {
      throw new InvalidArgumentError(
        `CusText mapping must be one of ('conservative', 'aggressive'), got '${this.mapping as string}'`);
    }
  }

  protected parameters(): [string, Described][] {
    return [["neighbours", { text: this.neighbours.describe() }], ["epsilon", { float: this.epsilon }],
      ["n_neighbours", { int: this.nNeighbours }], ["mapping", { text: this.mapping }]];
  }

  /** Not DP in the private context: `epsilon` covers a token swapped within its output set. */
  override releaseEvent(): ReleaseEvent {
    return ReleaseEvent.nonPrivate(
      "CusText's epsilon covers a token swapped within its output set, not the private context");
  }

  override llmSupport(): number {
    return 1;
  }

  override edgeToken(pSlm: Float32Array, pLlm: Float32Array, alpha: number, draws?: Draws): SyncedToken {
    const source = requireDraws(draws, this.name);
    const fusedArgmax = argmax(fuse(pLlm, pSlm, checkAlpha(alpha)));
    const { ids, similarities } = custextOutputSet(fusedArgmax, this.neighbours, this.nNeighbours, this.mapping);
    return new SyncedToken(ids[sampleFrom(custextProbabilities(similarities, this.epsilon), source)]);
  }
}
