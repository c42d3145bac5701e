/**
 * `never_upload`: spans of the private context whose tokens the SLM says nothing about to the cloud (Python:
 * `edge_sdk.privacy.masking` and `edge_sdk.steps.SLMView`).
 *
 * The SLM's values for the masked ids are removed before any policy runs: in probability space they are zeroed
 * and the rest divided by `1 - m` (`m` the masked mass), in logit space lowered to float32's minimum.  The mask
 * covers every spelling a model may produce mid-text (as given, lower, upper, capitalised and title case, each
 * with and without a leading space, each word alone, composed and accent-free forms), every vocabulary token
 * that spells a span's word up to case and accents, and every token spelling its first 3 or more letters.
 */

import { InvalidArgumentError } from "../core/errors.js";
import { checkFinite, FLOAT32_LOWEST, type FusionSpace, softmax, sumFloat64 } from "../core/fusion.js";

/** A full-vocabulary upload keeps only its this-many largest values (with every id listed, masked ones stand out). */
export const FULL_UPLOAD_LIMIT = 1000;
/** A vocabulary token spelling the first this-many or more letters of a span's word is masked with it. */
export const MIN_PREFIX_LETTERS = 3;

const f32 = Math.fround;

/**
 * Probability space: `p` with the masked ids zeroed and the rest renormalised by their float64 sum (rounded to
 * float32 once, as Python divides).  Writes into `p`.
 */
export function maskProbabilities(p: Float32Array, masked: ArrayLike<number>): Float32Array {
  if (masked.length === 0) return p;
  for (let j = 0; j < masked.length; j++) p[masked[j]] = 0;
  const total = sumFloat64(p);
  if (total > 0) {
    const divisor = f32(total);
    for (let i = 0; i < p.length; i++) p[i] = p[i] / divisor;
  }
  return p;
}

/** Logit space: the masked ids lowered to float32's minimum (a fresh row). */
export function maskLogits(z: Float32Array, masked: ArrayLike<number>): Float32Array {
  const out = Float32Array.from(z);
  for (let j = 0; j < masked.length; j++) out[masked[j]] = FLOAT32_LOWEST;
  return out;
}

/** The SLM's logits as a policy of `space` reads them, `masked` ids removed (Python: `SLMView.arrays`);
 * `NonFiniteError` for a row holding NaN or an infinity. */
export function slmView(logits: Float32Array, space: FusionSpace, masked: ArrayLike<number>): Float32Array {
  checkFinite(logits, "the SLM's logits");
  return space === "logit" ? maskLogits(logits, masked) : maskProbabilities(softmax(logits), masked);
}

// ------------------------------------------------------------------------------------------- the mask's ids

const COMBINING = /\p{M}/gu;
const PUNCTUATION = /^\p{P}$/u;
const SPACE = /^\s$/u;
const CASED = /^[\p{Lu}\p{Ll}\p{Lt}]$/u;
const UNSPACED = /^[\p{Script=Han}\p{Script=Hiragana}\p{Script=Katakana}\p{Script=Thai}\p{Script=Lao}\p{Script=Khmer}\p{Script=Myanmar}]$/u;

const isPunctuation = (ch: string): boolean => PUNCTUATION.test(ch);
const characters = (text: string): string[] => Array.from(text);
const splitWords = (text: string): string[] => text.split(/\s+/u).filter((word) => word.length > 0);

/** `text` up to case, accents and compatibility forms: NFKD, combining marks dropped, case-folded, trimmed. */
export function fold(text: string): string {
  return text.normalize("NFKD").replace(COMBINING, "").toUpperCase().toLowerCase().trim();
}

/** Every id of the vocabulary by its piece's {@link fold} (pieces that fold to nothing left out). */
export function foldedVocabulary(piece: (id: number) => string, vocabSize: number): Map<string, number[]> {
  const index = new Map<string, number[]>();
  for (let id = 0; id < vocabSize; id++) {
    const key = fold(piece(id));
    if (key) index.set(key, [...(index.get(key) ?? []), id]);
  }
  return index;
}

/** Whether `ch` belongs to a script written without spaces between words. */
export function unspaced(ch: string): boolean {
  return UNSPACED.test(ch);
}

/** `word` without the punctuation around it. */
function bare(word: string): string {
  const chars = characters(word);
  let start = 0;
  let end = chars.length;
  while (start < end && isPunctuation(chars[start])) start++;
  while (end > start && isPunctuation(chars[end - 1])) end--;
  return chars.slice(start, end).join("");
}

/** The words of `text` a model may write alone: each word, bare, its parts punctuation joins, unspaced characters. */
export function spokenWords(text: string): string[] {
  const words: string[] = [];
  for (const word of splitWords(text)) {
    const stripped = bare(word);
    const parts: string[] = [];
    let run = "";
    let runIsPunctuation: boolean | null = null;
    for (const ch of characters(stripped)) {
      const punctuation = isPunctuation(ch);
      if (runIsPunctuation !== null && punctuation !== runIsPunctuation) {
        if (!runIsPunctuation) parts.push(run);
        run = "";
      }
      run += ch;
      runIsPunctuation = punctuation;
    }
    if (runIsPunctuation === false) parts.push(run);
    words.push(word, stripped, ...(parts.length > 1 ? parts : []), ...characters(stripped).filter(unspaced));
  }
  return [...new Set(words.filter((word) => word.length > 0))];
}

/** Python's `str.capitalize`: the first character upper, the rest lower. */
function capitalize(text: string): string {
  const chars = characters(text);
  return chars.length ? chars[0].toUpperCase() + chars.slice(1).join("").toLowerCase() : text;
}

/** Python's `str.title`: a character after a cased one lower, any other upper. */
function title(text: string): string {
  let previousCased = false;
  let out = "";
  for (const ch of characters(text)) {
    out += previousCased ? ch.toLowerCase() : ch.toUpperCase();
    previousCased = CASED.test(ch);
  }
  return out;
}

/** The forms of `span` a model may generate: case variants of the span and of each word, with and without a space. */
export function spellings(span: string): string[] {
  const joined = splitWords(span).join(" ");
  const accentFree = joined.normalize("NFKD").replace(COMBINING, "");
  const forms: string[] = [];
  const seen = new Set<string>();
  for (const written of new Set([joined, joined.normalize("NFC"), joined.normalize("NFKC"), accentFree])) {
    for (const text of [written, ...spokenWords(written)]) {
      for (const variant of [text, text.toLowerCase(), text.toUpperCase(), capitalize(text), title(text)]) {
        for (const spaced of [variant, ` ${variant}`]) {
          if (variant && !seen.has(spaced)) {
            seen.add(spaced);
            forms.push(spaced);
          }
        }
      }
    }
  }
  return forms;
}

/** Whether a token spells only punctuation or whitespace (a U+FFFD byte fragment counts as content). */
function isPunctuationOrSpace(text: string): boolean {
  return !text.includes("\ufffd") && characters(text).every((ch) => SPACE.test(ch) || isPunctuation(ch));
}

/** Python's `repr` of a string, for messages that quote a span as Python does. */
function quoted(text: string): string {
  const quote = text.includes("'") && !text.includes('"') ? '"' : "'";
  return quote + text.replace(/\\/g, "\\\\").replace(new RegExp(quote, "g"), `\\${quote}`) + quote;
}

/**
 * Every token id that spells part of one of `spans` (see the module comment).  `vocabulary`: the model's
 * {@link foldedVocabulary}.  `InvalidArgumentError` for a span that does not occur in `privateContext` (up to
 * case and accents) or that has no maskable token (only punctuation or whitespace).
 */
export function neverUploadIds(
  spans: Iterable<string>,
  privateContext: string,
  tokenize: (text: string) => number[],
  piece: (id: number) => string,
  vocabulary?: Map<string, number[]>,
): Set<number> {
  const masked = new Set<number>();
  const contextWords = spokenWords(privateContext);
  const foldedContext = fold(splitWords(privateContext).join(" "));
  for (const span of spans) {
    if (!span.trim()) throw new InvalidArgumentError("a never_upload span must not be empty");
    if (!privateContext.includes(span) && !foldedContext.includes(fold(span))) {
      throw new InvalidArgumentError(`never_upload span ${quoted(span)} does not occur in the private context`);
    }
    const words = new Set(spokenWords(span).map(fold).filter((word) => word !== ""));
    const variants = contextWords.map(bare).filter((word) => words.has(fold(word)));
    const forms = [...spellings(span), ...variants.flatMap(spellings)];
    const ids = new Set<number>();
    for (const form of forms) for (const id of tokenize(form)) if (!isPunctuationOrSpace(piece(id))) ids.add(id);
    if (vocabulary !== undefined) {
      const keys = new Set<string>();
      for (const word of words) {
        const chars = characters(word);
        for (let end = Math.min(MIN_PREFIX_LETTERS, chars.length); end <= chars.length; end++) {
          keys.add(chars.slice(0, end).join(""));
        }
        if (chars.some(unspaced)) {
          for (let start = 0; start < chars.length; start++) {
            for (let end = start + 1; end <= chars.length; end++) keys.add(chars.slice(start, end).join(""));
          }
        }
      }
      for (const key of keys) for (const id of vocabulary.get(key) ?? []) if (!isPunctuationOrSpace(piece(id))) ids.add(id);
    }
    if (ids.size === 0) {
      throw new InvalidArgumentError(
        `never_upload span ${quoted(span)} has no token that could be masked (only punctuation)`,
      );
    }
    for (const id of ids) masked.add(id);
  }
  return masked;
}
