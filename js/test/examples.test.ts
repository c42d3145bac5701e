/**
 * The guide's `llama.rn` backend is the example that `npm run typecheck` compiles: the TypeScript block under
 * docs/guides/typescript.md's "A `llama.rn` backend" appears verbatim in js/examples/llama-rn/LlamaRnSLM.ts.
 */

import { readFileSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { expect, it } from "vitest";

const root = join(fileURLToPath(new URL(".", import.meta.url)), "..", "..");

it("the guide's llama.rn block is the typechecked example's code", () => {
  const guide = readFileSync(join(root, "docs", "guides", "typescript.md"), "utf8");
  const section = guide.slice(guide.indexOf("## A `llama.rn` backend"));
  const block = /```ts\n([\s\S]*?)```/.exec(section)?.[1];
  expect(block, "a ts block in the section").toBeDefined();
  expect(block!.split("\n").length).toBeGreaterThan(20); // the class, not a fragment of it
  expect(readFileSync(join(root, "js", "examples", "llama-rn", "LlamaRnSLM.ts"), "utf8")).toContain(block!);
});
