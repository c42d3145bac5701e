/**
 * Cloud-side greedy fusion: the token the cloud will pick, when its row and the upload pin it down (Python:
 * `edge_sdk.fusion.certified_cloud_pick`).
 */

/** Slack for comparing float32-derived values: `1e-6 * |value| + 1e-12`. */
export function roundingMargin(value: number): number {
  return 1e-6 * Math.abs(value) + 1e-12;
}

/**
 * `argmax s` from a sparse row and an upload when the row certifies it, else `null`:
 * `s(i) = alpha * p_llm(i) + (1 - alpha) * m(i) * u(i)` with the `excluded` ids out of the choice.  An omitted id
 * `j` has `p_llm(j) <= tailBound`, so `s(j) <= alpha * tailBound + (1 - alpha) * max(u(j) over omitted uploaded j,
 * 0 if some omitted j is not)`.  The best known id is the pick when its score beats that bound and the second
 * known score by a rounding margin.  Everything read here is what the cloud holds.
 */
export function certifiedFusedArgmax(
  knownIds: ArrayLike<number>,
  knownLlm: ArrayLike<number>,
  tailBound: number,
  uploadIds: ArrayLike<number>,
  uploadValues: ArrayLike<number>,
  alpha: number,
  vocabSize: number,
  excluded: ReadonlySet<number>,
): number | null {
  const slm = new Float32Array(vocabSize);
  const uploaded = new Uint8Array(vocabSize);
  for (let j = 0; j < uploadIds.length; j++) {
    slm[uploadIds[j]] = uploadValues[j];
    uploaded[uploadIds[j]] = 1;
  }
  const a = Math.fround(alpha);
  const b = Math.fround(1 - alpha);
  // the best and second-best known score (ties: the earlier in the row's order, as a stable sort keeps it)
  let bestId = -1;
  let best = -Infinity;
  let second = -Infinity;
  let allowed = 0;
  for (let j = 0; j < knownIds.length; j++) {
    const id = knownIds[j];
    if (excluded.has(id)) continue;
    allowed++;
    const score = Math.fround(Math.fround(a * knownLlm[j]) + Math.fround(b * slm[id]));
    if (bestId < 0 || score > best) {
      second = best;
      [bestId, best] = [id, score];
    } else if (score > second) {
      second = score;
    }
  }
  if (!allowed) return null;
  const rivals: number[] = allowed > 1 ? [second] : [];
  const known = new Uint8Array(vocabSize);
  for (let j = 0; j < knownIds.length; j++) known[knownIds[j]] = 1;
  let anyOmitted = false;
  let uploadPart = -Infinity;
  for (let id = 0; id < vocabSize; id++) {
    if (known[id]) continue;
    anyOmitted = true;
    uploadPart = Math.max(uploadPart, uploaded[id] ? slm[id] : 0);
  }
  if (anyOmitted) rivals.push(alpha * tailBound + (1 - alpha) * uploadPart);
  if (!rivals.length) return bestId;
  const rival = Math.max(...rivals);
  return best > rival + roundingMargin(Math.abs(best) + Math.abs(rival) + Math.abs(tailBound)) ? bestId : null;
}
