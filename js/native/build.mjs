#!/usr/bin/env node
/**
 * Build native/build/coveil_llama.node, the addon LlamaCppNativeSLM loads (npm run build:native).
 *
 * It compiles native/coveil_llama.c with gcc against the llama.cpp that node-llama-cpp ships, and nothing is
 * downloaded: the headers (llama.h, ggml*.h, gguf.h) come from the llama.cpp source node-llama-cpp carries as a git
 * bundle (node-llama-cpp/llama/gitRelease.bundle, the commit its binaries were built from), Node-API's from this
 * Node's include folder, and the addon links to node-llama-cpp's prebuilt libllama/libggml with an rpath to their
 * folder.  Linux x64 only (the platform whose prebuilt binaries the package pins); elsewhere it fails, saying so.
 */

import { execFileSync } from "node:child_process";
import { existsSync, mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const out = join(here, "build");
const HEADERS = ["include/llama.h", "ggml/include/ggml.h", "ggml/include/ggml-cpu.h", "ggml/include/ggml-backend.h",
  "ggml/include/ggml-alloc.h", "ggml/include/ggml-opt.h", "ggml/include/gguf.h"];

function fail(message) {
  console.error(`build:native: ${message}`);
  process.exit(1);
}

if (process.platform !== "linux" || process.arch !== "x64") {
  fail(`the native backend builds on linux-x64 only (node-llama-cpp's prebuilt library for it), not ${process.platform}-${process.arch}`);
}
const require = createRequire(import.meta.url);
/** An installed package's folder, where Node would find it from here (node-llama-cpp exports no package.json). */
function packageDir(name) {
  const dir = require.resolve.paths(name).map((base) => join(base, name)).find((d) => existsSync(join(d, "package.json")));
  if (dir === undefined) fail(`${name} is not installed (npm ci in js/)`);
  return dir;
}
const nodeLlamaCpp = packageDir("node-llama-cpp");
const libDir = join(packageDir("@node-llama-cpp/linux-x64"), "bins", "linux-x64");
const metadata = JSON.parse(readFileSync(join(libDir, "_nlcBuildMetadata.json"), "utf8"));
const release = metadata.buildOptions.llamaCpp.release;
const source = JSON.parse(readFileSync(join(nodeLlamaCpp, "llama", "llama.cpp.info.json"), "utf8")).tag;
if (release !== source) fail(`node-llama-cpp's binaries are llama.cpp ${release}, its bundled source ${source}: no matching headers`);
const libraries = ["libllama", "libggml", "libggml-base"].map((stem) => {
  const name = [`${stem}.${release}.so`, `${stem}.so`].find((file) => existsSync(join(libDir, file)));
  if (name === undefined) fail(`no ${stem}*.so in ${libDir}`);
  return name;
});

// the headers of the bundle's commit (the source node-llama-cpp builds its binaries from)
rmSync(out, { recursive: true, force: true });
mkdirSync(join(out, "include"), { recursive: true });
const git = join(out, "llama.cpp.git");
execFileSync("git", ["init", "-q", "--bare", git]);
const heads = execFileSync("git", ["-C", git, "bundle", "unbundle", join(nodeLlamaCpp, "llama", "gitRelease.bundle")], { encoding: "utf8" });
const commit = heads.trim().split(/\s+/)[0];
for (const header of HEADERS) {
  writeFileSync(join(out, "include", header.split("/").pop()), execFileSync("git", ["-C", git, "show", `${commit}:${header}`]));
}
rmSync(git, { recursive: true, force: true });

const nodeInclude = [join(dirname(process.execPath), "..", "include", "node"), "/usr/include/node"]
  .find((dir) => existsSync(join(dir, "node_api.h")));
if (nodeInclude === undefined) fail("no node_api.h next to this Node or in /usr/include/node");

// -ffp-contract=off: the softmax's float arithmetic rounds step by step, as the SDK's TypeScript one does
execFileSync("gcc", ["-std=c11", "-O2", "-ffp-contract=off", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror",
  "-I", nodeInclude, "-I", join(out, "include"), join(here, "coveil_llama.c"),
  "-o", join(out, "coveil_llama.node"),
  "-L", libDir, ...libraries.map((name) => `-l:${name}`), `-Wl,-rpath,${libDir}`, "-lm"], { stdio: "inherit" });
writeFileSync(join(out, "build.json"), JSON.stringify({ libDir, llamaCpp: release, commit }, null, 2) + "\n");
console.log(`build:native: ${join(out, "coveil_llama.node")} (llama.cpp ${release}, ${commit.slice(0, 12)}, ${libDir})`);
