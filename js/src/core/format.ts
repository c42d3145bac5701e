/** Numbers written as Python writes them, so labels and ledgers read the same at both ends. */

/** The shortest digits and decimal exponent of `value` (finite, non-zero): `1.5e-5` gives `["15", -5]`. */
function shortest(value: number): [string, number] {
  const [mantissa, exponent] = Math.abs(value).toExponential().split("e");
  return [mantissa.replace(".", ""), Number(exponent)];
}

function exponentPart(exponent: number): string {
  return `e${exponent < 0 ? "-" : "+"}${String(Math.abs(exponent)).padStart(2, "0")}`;
}

/** `repr(value)` of a Python float: `1.0`, `0.05`, `1e-05`, `inf`. */
export function pyRepr(value: number): string {
  if (Number.isNaN(value)) return "nan";
  if (!Number.isFinite(value)) return value > 0 ? "inf" : "-inf";
  if (value === 0) return Object.is(value, -0) ? "-0.0" : "0.0";
  const sign = value < 0 ? "-" : "";
  const [digits, exponent] = shortest(value);
  if (exponent < -4 || exponent >= 16) {
    const mantissa = digits.length > 1 ? `${digits[0]}.${digits.slice(1)}` : digits;
    return `${sign}${mantissa}${exponentPart(exponent)}`;
  }
  if (exponent < 0) return `${sign}0.${"0".repeat(-exponent - 1)}${digits}`;
  const whole = digits.padEnd(exponent + 1, "0");
  const point = exponent + 1;
  const fraction = whole.slice(point);
  return `${sign}${whole.slice(0, point)}.${fraction.length ? fraction : "0"}`;
}

/** Python's `format(value, ".{precision}g")` (`"g"` is precision 6). */
export function pyG(value: number, precision = 6): string {
  if (Number.isNaN(value)) return "nan";
  if (!Number.isFinite(value)) return value > 0 ? "inf" : "-inf";
  if (value === 0) return Object.is(value, -0) ? "-0" : "0";
  const p = Math.max(precision, 1);
  const [mantissa, exponentText] = value.toExponential(p - 1).split("e");
  const exponent = Number(exponentText);
  const strip = (text: string): string => (text.includes(".") ? text.replace(/\.?0+$/, "") : text);
  if (exponent < -4 || exponent >= p) return `${strip(mantissa)}${exponentPart(exponent)}`;
  return strip(value.toFixed(Math.max(p - 1 - exponent, 0)));
}

/** `repr()` of a value a caller passed, as Python prints the same JSON value: an integral number as an `int`
 * (`-1`), any other number as a float (`pyRepr`), a string quoted (`'auto'`), `True`/`False`, `None`. */
export function pyValueRepr(value: unknown): string {
  if (value === null || value === undefined) return "None";
  if (typeof value === "boolean") return value ? "True" : "False";
  if (typeof value === "number") return Number.isInteger(value) ? String(value) : pyRepr(value);
  if (typeof value === "bigint") return String(value);
  if (typeof value === "string") return `'${value.replaceAll("\\", "\\\\").replaceAll("'", "\\'")}'`;
  return String(value);
}
