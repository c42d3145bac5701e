#!/usr/bin/env node
/**
 * Build the addon LlamaCppNativeSLM loads (npm run build:native [-- --llama llama-cpp-python]), one build per
 * llama.cpp library, each in its own folder with the build.json that names the library:
 *
 * - `--llama node-llama-cpp` (the default): native/build/node-llama-cpp/.  The llama.cpp node-llama-cpp ships;
 *   the headers (llama.h, ggml*.h, gguf.h) come from the llama.cpp source node-llama-cpp carries as a git bundle
 *   (node-llama-cpp/llama/gitRelease.bundle, the commit its binaries were built from); it links node-llama-cpp's
 *   prebuilt libllama/libggml with an rpath to their folder.
 * - `--llama llama-cpp-python`: native/build/llama-cpp-python/.  The llama.cpp the Python SDK runs: the headers
 *   and shared libraries llama-cpp-python installs (site-packages/include, site-packages/llama_cpp/lib), found
 *   through the Python the end-to-end tests use (`COVEIL_PYTHON`, else the repository's .venv, else `python`).
 *
 * gcc, Node-API's header from this Node's include folder, nothing downloaded.  Linux x64 only (the platform whose
 * prebuilt binaries the packages pin); elsewhere it fails, saying so.
 */

import { execFileSync } from "node:child_process";
import { existsSync, mkdirSync, readFileSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const LIBRARIES = ["node-llama-cpp", "llama-cpp-python"];
const HEADERS = ["include/llama.h", "ggml/include/ggml.h", "ggml/include/ggml-cpu.h", "ggml/include/ggml-backend.h",
  "ggml/include/ggml-alloc.h", "ggml/include/ggml-opt.h", "ggml/include/gguf.h"];

function fail(message) {
  console.error(`build:native: ${message}`);
  process.exit(1);
}

const args = process.argv.slice(2);
const flag = args.indexOf("--llama");
if ((flag < 0 && args.length) || (flag >= 0 && args.length !== 2)) fail(`usage: node native/build.mjs [--llama ${LIBRARIES.join("|")}]`);
const library = flag < 0 ? "node-llama-cpp" : args[flag + 1];
if (!LIBRARIES.includes(library)) fail(`--llama must be one of ${LIBRARIES.join(", ")}, got ${library}`);
if (process.platform !== "linux" || process.arch !== "x64") {
  fail(`the native backend builds on linux-x64 only (the llama.cpp libraries' prebuilt platform), not ${process.platform}-${process.arch}`);
}
const out = join(here, "build", library);
rmSync(out, { recursive: true, force: true });
mkdirSync(out, { recursive: true });

/** node-llama-cpp's library folder, its libraries, headers written to out/include; build.json's fields */
function nodeLlamaCpp() {
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
  mkdirSync(join(out, "include"));
  const git = join(out, "llama.cpp.git");
  execFileSync("git", ["init", "-q", "--bare", git]);
  const heads = execFileSync("git", ["-C", git, "bundle", "unbundle", join(nodeLlamaCpp, "llama", "gitRelease.bundle")], { encoding: "utf8" });
  const commit = heads.trim().split(/\s+/)[0];
  for (const header of HEADERS) {
    writeFileSync(join(out, "include", header.split("/").pop()), execFileSync("git", ["-C", git, "show", `${commit}:${header}`]));
  }
  rmSync(git, { recursive: true, force: true });
  return { include: join(out, "include"), libDir, libraries, info: { llamaCpp: release, commit } };
}

/** llama-cpp-python's library folder and headers, as the Python SDK's Python imports them; build.json's fields */
function llamaCppPython() {
  const repo = join(here, "..", "..");
  const python = process.env.COVEIL_PYTHON
    ?? (existsSync(join(repo, ".venv", "bin", "python")) ? join(repo, ".venv", "bin", "python") : "python");
  let found;
  try {
    found = execFileSync(python, ["-c", "import json, os, sysconfig, llama_cpp; print(json.dumps({'package': " +
      "os.path.dirname(llama_cpp.__file__), 'version': llama_cpp.__version__, 'site': sysconfig.get_paths()['purelib']}))"],
    { encoding: "utf8" });
  } catch (error) {
    fail(`${python} cannot import llama_cpp (set COVEIL_PYTHON to the Python with llama-cpp-python): ${error.message}`);
  }
  const { package: packageDir, version, site } = JSON.parse(found);
  const include = join(site, "include");
  if (!existsSync(join(include, "llama.h"))) fail(`llama-cpp-python ${version} installed no llama.h in ${include}`);
  const libDir = join(packageDir, "lib");
  const libraries = ["libllama.so.0", "libggml.so.0", "libggml-base.so.0"];
  for (const name of libraries) if (!existsSync(join(libDir, name))) fail(`no ${name} in ${libDir}`);
  const libllama = readdirSync(libDir).find((name) => /^libllama\.so\.\d+\.\d+\.\d+$/.test(name));
  return { include, libDir, libraries, info: { llamaCppPython: version, libllama: libllama?.slice("libllama.so.".length) ?? null } };
}

const { include, libDir, libraries, info } = library === "node-llama-cpp" ? nodeLlamaCpp() : llamaCppPython();

const nodeInclude = [join(dirname(process.execPath), "..", "include", "node"), "/usr/include/node"]
  .find((dir) => existsSync(join(dir, "node_api.h")));
if (nodeInclude === undefined) fail("no node_api.h next to this Node or in /usr/include/node");

// -ffp-contract=off: the softmax's float arithmetic rounds step by step, as the SDK's TypeScript one does
execFileSync("gcc", ["-std=c11", "-O2", "-ffp-contract=off", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror",
  "-I", nodeInclude, "-I", include, join(here, "coveil_llama.c"),
  "-o", join(out, "coveil_llama.node"),
  "-L", libDir, ...libraries.map((name) => `-l:${name}`), `-Wl,-rpath,${libDir}`, "-lm"], { stdio: "inherit" });
writeFileSync(join(out, "build.json"), JSON.stringify({ library, libDir, ...info }, null, 2) + "\n");
console.log(`build:native: ${join(out, "coveil_llama.node")} (${library}: ${JSON.stringify(info)}, ${libDir})`);
