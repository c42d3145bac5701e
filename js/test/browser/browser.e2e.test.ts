/**
 * The browser example (examples/browser: wllama and the SDK in a page) in headless Chromium against the adapter's
 * WebSocket route on loopback: it answers a MedPriv question, shows the ledger, and a screenshot is saved
 * (test-results/browser.png).  `COVEIL_CHROMIUM` names the browser (default /usr/bin/chromium).
 */

import { createReadStream, mkdirSync, mkdtempSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { extname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { readGgufFileInfo } from "node-llama-cpp";
import { chromium } from "playwright-core";
import { build } from "vite";
import { afterAll, beforeAll, expect, it } from "vitest";
import { vocabFingerprint } from "../../src/backends/nodeLlamaCpp.js";
import { MEDPRIV, embeddedGguf, pythonEdge, startAdapter, type Adapter } from "../e2e/adapter.js";

const here = fileURLToPath(new URL(".", import.meta.url));
const example = join(here, "..", "..", "examples", "browser");
const TOKEN = "tok-browser";
/** the MedPriv item and how many tokens the page decodes (`COVEIL_BROWSER_ITEM`, `COVEIL_BROWSER_TOKENS` to measure others) */
const ITEM = Number(process.env.COVEIL_BROWSER_ITEM ?? 1);
const TOKENS = Number(process.env.COVEIL_BROWSER_TOKENS ?? 12);
const TYPES: Record<string, string> = { ".html": "text/html", ".js": "text/javascript", ".wasm": "application/wasm" };

let adapter: Adapter;
let server: Server;
/** the adapter's token file's folder, removed after the test */
let dir: string | undefined;

beforeAll(async () => {
  dir = mkdtempSync(join(tmpdir(), "coveil-browser-"));
  writeFileSync(join(dir, "tokens.txt"), `${TOKEN}\n`);
  adapter = await startAdapter(["--token-file", join(dir, "tokens.txt")], true);
}, 300_000);

afterAll(() => {
  server?.close();
  adapter?.stop();
  if (dir !== undefined) rmSync(dir, { recursive: true, force: true });
});

it("answers a MedPriv question in headless Chromium with wllama, over WebSocket, showing the ledger", async () => {
  await build({ configFile: join(example, "vite.config.ts"), logLevel: "warn" });
  const gguf = await embeddedGguf();
  const info = await readGgufFileInfo(gguf.path);
  const tokens = (info.metadata as { tokenizer: { ggml: { tokens: readonly string[] } } }).tokenizer.ggml.tokens;
  const fingerprint = Buffer.from(vocabFingerprint(tokens)).toString("hex");
  server = createServer((request, response) => {
    const path = new URL(request.url!, "http://x").pathname;
    const file = path === "/model.gguf" ? gguf.path : join(example, "dist", path === "/" ? "index.html" : path);
    try {
      const size = statSync(file).size;
      response.writeHead(200, { "Content-Type": TYPES[extname(file)] ?? "application/octet-stream", "Content-Length": size });
      createReadStream(file).pipe(response);
    } catch {
      response.writeHead(404).end();
    }
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const origin = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  const item = readFileSync(MEDPRIV, "utf8").split("\n")[ITEM];
  const query = new URLSearchParams({ ws: adapter.wsUrl!, model: `${origin}/model.gguf`, name: gguf.name, fingerprint,
    token: TOKEN, item, tokens: String(TOKENS) });
  // the Python SDK's greedy run of the same item, policy (CoVeil, edge-side) and length, against the same adapter
  const python = pythonEdge(adapter.target, ITEM, { mode: "edge", maxNewTokens: TOKENS, policy: "coveil", token: TOKEN });

  const browser = await chromium.launch({ executablePath: process.env.COVEIL_CHROMIUM ?? "/usr/bin/chromium", args: ["--no-sandbox"] });
  try {
    const page = await browser.newPage();
    const console: string[] = [];
    page.on("console", (message) => console.push(message.text()));
    await page.goto(`${origin}/?${query}`);
    await page.waitForFunction(() => document.title === "done" || document.title === "error", undefined, { timeout: 600_000 });
    mkdirSync(join(here, "..", "..", "test-results"), { recursive: true });
    await page.screenshot({ path: join(here, "..", "..", "test-results", "browser.png"), fullPage: true });
    const status = await page.textContent("#status");
    expect(status, console.join("\n")).toMatch(new RegExp(`^done: ${TOKENS} tokens`));
    expect(await page.locator("#ledger tr").count()).toBe(1 + TOKENS); // the header and one row per step
    expect((await page.textContent("#answer"))!.length).toBeGreaterThan(0);
    const answer = page.locator("#answer");
    const [tokens, prompt] = [await answer.getAttribute("data-tokens"), await answer.getAttribute("data-prompt")].map((j) => JSON.parse(j!) as number[]);
    const expected = await python;
    expect(prompt).toEqual(expected.slm_prompt); // wllama's tokenizer: the Python SDK's prompt ids
    let agree = 0;
    while (agree < tokens.length && tokens[agree] === expected.tokens[agree]) agree++;
    process.stderr.write(`browser (wllama) vs the Python SDK, item ${ITEM}: first ${agree} of ${TOKENS} tokens agree\n` +
      `  wllama ${JSON.stringify(tokens)}\n  python ${JSON.stringify(expected.tokens)}\n`);
    expect(tokens).toEqual(expected.tokens);
  } finally {
    await browser.close();
  }
}, 900_000);
