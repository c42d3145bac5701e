/**
 * The package as an app installs it: the built dist/ (`npm run build`; `npm test` builds it first), its entries and
 * what each one imports.  The root entry and `./browser` must load in a browser or React Native app that installed
 * `@coveil/edge` alone: they import `@bufbuild/protobuf` (its one dependency) and, for `./browser`, `@wllama/wllama`,
 * and no Node built-in; `./node` may import the Node peers, each loaded when used, and one that is missing is
 * `MissingPeerDependencyError` naming it.
 */

import { execFileSync } from "node:child_process";
import { cpSync, existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { init, parse } from "es-module-lexer";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

const root = join(import.meta.dirname, "..");
const dist = join(root, "dist");
const pkg = JSON.parse(readFileSync(join(root, "package.json"), "utf8")) as {
  name: string;
  exports: Record<string, { types: string; import: string }>;
  dependencies: Record<string, string>;
  devDependencies: Record<string, string>;
  peerDependencies: Record<string, string>;
  peerDependenciesMeta: Record<string, { optional: boolean }>;
};
const NODE_PEERS = ["@grpc/grpc-js", "ws", "node-llama-cpp"];
const PEERS = [...NODE_PEERS, "@wllama/wllama"];

/** The package a bare specifier names (`@scope/name/sub` -> `@scope/name`), or the Node built-in (`node:fs`). */
function packageOf(specifier: string): string {
  const parts = specifier.split("/");
  return specifier.startsWith("@") ? parts.slice(0, 2).join("/") : parts[0];
}

/** Every module the entry `file` reaches through its imports (static, and dynamic ones naming a string), and the
 * packages they import. */
function importGraph(file: string): { modules: Set<string>; packages: Set<string> } {
  const modules = new Set<string>();
  const packages = new Set<string>();
  const visit = (path: string) => {
    if (modules.has(path)) return;
    modules.add(path);
    const [imports] = parse(readFileSync(path, "utf8"), path);
    for (const { n: specifier, d } of imports) {
      if (specifier === undefined) {
        expect(d, `${path}: an import() of a computed name`).toBe(-2); // -2: import.meta
        continue;
      }
      if (specifier.startsWith(".")) visit(resolve(dirname(path), specifier));
      else packages.add(packageOf(specifier));
    }
  };
  visit(file);
  return { modules, packages };
}

beforeAll(async () => {
  expect(existsSync(join(dist, "index.js")), "dist/ is not built: npm run build (npm test builds it)").toBe(true);
  await init;
});

describe("the package's entries and dependencies", () => {
  it("exports the root, ./browser and ./node, each built with its types", () => {
    expect(Object.keys(pkg.exports).sort()).toEqual([".", "./browser", "./node"]);
    for (const { types, import: file } of Object.values(pkg.exports)) {
      expect(existsSync(join(root, file)), file).toBe(true);
      expect(existsSync(join(root, types)), types).toBe(true);
    }
  });

  it("depends on @bufbuild/protobuf alone; the runtimes' packages are optional peers, installed for the tests", () => {
    expect(Object.keys(pkg.dependencies)).toEqual(["@bufbuild/protobuf"]);
    expect(Object.keys(pkg.peerDependencies).sort()).toEqual([...PEERS].sort());
    for (const peer of PEERS) {
      expect(pkg.peerDependenciesMeta[peer], peer).toEqual({ optional: true });
      expect(pkg.devDependencies[peer], peer).toBeDefined();
    }
  });

  it("the root entry imports @bufbuild/protobuf and nothing else, no Node built-in", () => {
    const { modules, packages } = importGraph(join(dist, "index.js"));
    expect([...packages]).toEqual(["@bufbuild/protobuf"]);
    expect(modules.size).toBeGreaterThan(30); // the whole core, policies, loop and wire
  });

  it("./browser imports at most @bufbuild/protobuf and @wllama/wllama, no Node built-in", () => {
    const { modules, packages } = importGraph(join(dist, "browser.js"));
    expect(modules).toContain(join(dist, "backends", "wllama.js"));
    for (const name of packages) expect(["@bufbuild/protobuf", "@wllama/wllama"], name).toContain(name);
  });

  it("./node imports only the Node peers, @bufbuild/protobuf and Node built-ins", () => {
    const { packages } = importGraph(join(dist, "node.js"));
    for (const name of packages) {
      expect(name.startsWith("node:") || ["@bufbuild/protobuf", ...NODE_PEERS].includes(name), name).toBe(true);
    }
  });

  it("npm pack ships dist/, the native sources, README and package.json: no tests, benchmarks, examples or sources", () => {
    const [report] = JSON.parse(execFileSync("npm", ["pack", "--dry-run", "--json", "--ignore-scripts"],
      { cwd: root, encoding: "utf-8", stdio: ["ignore", "pipe", "ignore"] })) as { files: { path: string }[] }[];
    const paths = report.files.map((f) => f.path);
    const stray = paths.filter((p) => !/^(dist\/.+|native\/coveil_llama\.c|native\/build\.mjs|README\.md|package\.json)$/.test(p));
    expect(stray).toEqual([]);
    for (const { types, import: file } of Object.values(pkg.exports)) {
      expect(paths).toEqual(expect.arrayContaining([types.slice(2), file.slice(2)]));
    }
  });

  it("the browser example imports the SDK from the package's entries only", () => {
    const source = readFileSync(join(root, "examples", "browser", "main.ts"), "utf8");
    const specifiers = [...source.matchAll(/^import .* from "([^"]+)";$/gm)].map((m) => m[1]);
    expect(specifiers.filter((s) => s.startsWith("."))).toEqual([]);
    expect(specifiers).toEqual(expect.arrayContaining(["@coveil/edge", "@coveil/edge/browser"]));
  });
});

describe("installed with @bufbuild/protobuf alone", () => {
  let app: string;

  beforeAll(() => {
    // an app's node_modules: a copy of the package (a link would resolve the peers from this checkout) and its one
    // dependency
    app = mkdtempSync(join(tmpdir(), "coveil-app-"));
    const installed = join(app, "node_modules", "@coveil", "edge");
    mkdirSync(installed, { recursive: true });
    cpSync(join(root, "package.json"), join(installed, "package.json"));
    cpSync(dist, join(installed, "dist"), { recursive: true });
    mkdirSync(join(app, "node_modules", "@bufbuild"));
    symlinkSync(join(root, "node_modules", "@bufbuild", "protobuf"), join(app, "node_modules", "@bufbuild", "protobuf"));
  });

  afterAll(() => rmSync(app, { recursive: true, force: true }));

  it("every entry loads; a Node peer that is used and missing is MissingPeerDependencyError naming the package", () => {
    const script = `
      const edge = await import("@coveil/edge");
      const browser = await import("@coveil/edge/browser");
      const node = await import("@coveil/edge/node");
      const out = { root: typeof edge.CollaborativeDecoder, browser: typeof browser.WllamaSLM };
      const named = (error) => [error instanceof edge.MissingPeerDependencyError, error.code, error.packageName, error.message];
      try { new node.GrpcCarrier("127.0.0.1:1", { plaintext: true }); } catch (error) { out.grpc = named(error); }
      try { node.nodeWebSocket.open("ws://127.0.0.1:1", []); } catch (error) { out.ws = named(error); }
      try { await node.NodeLlamaCppSLM.load("model.gguf"); } catch (error) { out.llama = named(error); }
      console.log(JSON.stringify(out));`;
    writeFileSync(join(app, "main.mjs"), script);
    const out = JSON.parse(execFileSync(process.execPath, ["main.mjs"], { cwd: app }).toString());
    expect(out.root).toBe("function");
    expect(out.browser).toBe("function");
    expect(out.grpc).toEqual([true, "FAILED_PRECONDITION", "@grpc/grpc-js", "the gRPC carrier (GrpcCarrier) needs " +
      "the package @grpc/grpc-js, an optional peer dependency of @coveil/edge that is not installed: npm install @grpc/grpc-js"]);
    expect(out.ws).toEqual([true, "FAILED_PRECONDITION", "ws", "the Node WebSocket carrier (nodeWebSocket) needs the " +
      "package ws, an optional peer dependency of @coveil/edge that is not installed: npm install ws"]);
    expect(out.llama).toEqual([true, "FAILED_PRECONDITION", "node-llama-cpp", "NodeLlamaCppSLM needs the package " +
      "node-llama-cpp, an optional peer dependency of @coveil/edge that is not installed: npm install node-llama-cpp"]);
  });
});
