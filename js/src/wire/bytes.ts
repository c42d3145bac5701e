/**
 * Arrays on the wire: little-endian raw bytes, `uint32` ids and `float32` values (`proto/coveil.proto`), as
 * Python's `edge_sdk.protocol.wire.ids_to_bytes` / `values_from_bytes` write and read them.
 */

import { InvalidArgumentError } from "../core/errors.js";

/** Whether this platform stores numbers little-endian (then a typed array's bytes are the wire's bytes). */
const LITTLE_ENDIAN = new Uint8Array(new Uint32Array([1]).buffer)[0] === 1;

/** `ids` as little-endian `uint32` bytes. */
export function idsToBytes(ids: ArrayLike<number>): Uint8Array {
  const out = new Uint32Array(ids.length);
  for (let i = 0; i < ids.length; i++) out[i] = ids[i];
  return LITTLE_ENDIAN ? new Uint8Array(out.buffer) : swapped(new Uint8Array(out.buffer));
}

/** `values` as little-endian `float32` bytes (each value rounded to float32). */
export function valuesToBytes(values: ArrayLike<number>): Uint8Array {
  const out = values instanceof Float32Array ? values.slice() : Float32Array.from(values);
  return LITTLE_ENDIAN ? new Uint8Array(out.buffer) : swapped(new Uint8Array(out.buffer));
}

function checkWords(data: Uint8Array, what: string): void {
  if (data.length % 4) throw new InvalidArgumentError(`${what} bytes must be a multiple of 4 long, got ${data.length}`);
}

/** `data`'s bytes in a fresh, aligned buffer of their own (a Node `Buffer`'s `slice` is a view of its pool). */
function copied(data: Uint8Array): Uint8Array {
  const copy = new Uint8Array(data.length);
  copy.set(data);
  return copy;
}

/** Little-endian `uint32` bytes as ids (a copy, aligned); `InvalidArgumentError` when not a whole number of words. */
export function idsFromBytes(data: Uint8Array): Uint32Array {
  checkWords(data, "id");
  const copy = copied(data);
  return new Uint32Array(LITTLE_ENDIAN ? copy.buffer : swapped(copy).buffer, 0, data.length / 4);
}

/** Little-endian `float32` bytes as values (a copy, aligned); `InvalidArgumentError` when not a whole number of words. */
export function valuesFromBytes(data: Uint8Array): Float32Array {
  checkWords(data, "value");
  const copy = copied(data);
  return new Float32Array(LITTLE_ENDIAN ? copy.buffer : swapped(copy).buffer, 0, data.length / 4);
}

/** Each 4-byte word's bytes reversed, in place (big-endian platforms only). */
function swapped(bytes: Uint8Array): Uint8Array {
  for (let i = 0; i < bytes.length; i += 4) {
    const [a, b] = [bytes[i], bytes[i + 1]];
    bytes[i] = bytes[i + 3];
    bytes[i + 1] = bytes[i + 2];
    bytes[i + 2] = b;
    bytes[i + 3] = a;
  }
  return bytes;
}
