/**
 * The package's size without a model, as `npm pack` ships it: `npm pack --dry-run --json` runs `prepack` (a clean
 * build of dist/; not the native addons, whose C source and build script ship instead), then lists the files.
 * Fails when a file outside dist/, the native sources, README.md and package.json would ship (test/, bench/,
 * dist-bench/, examples/, src/, native/build/), or an entry's file would not.  Usage (from js/): npm run bench:pack
 *
 * The last lines are name=value: package_files, package_tarball_bytes (the .tgz) and package_bytes (unpacked;
 * target <= 1 MB = 1,000,000 bytes).
 */

import { execFileSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { dirname, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const TARGET_BYTES = 1_000_000;
const SHIPPED = /^(dist\/.+|native\/coveil_llama\.c|native\/build\.mjs|README\.md|package\.json)$/;

interface PackReport { size: number; unpackedSize: number; entryCount: number; files: { path: string; size: number }[] }

function main(): void {
  const root = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..");
  const [report] = JSON.parse(execFileSync("npm", ["pack", "--dry-run", "--json"], { cwd: root, encoding: "utf-8",
    stdio: ["ignore", "pipe", "ignore"] })) as PackReport[];
  const paths = report.files.map((f) => f.path);
  const stray = paths.filter((path) => !SHIPPED.test(path));
  const exports = JSON.parse(readFileSync(resolve(root, "package.json"), "utf8")).exports as Record<string, Record<string, string>>;
  const entries = Object.values(exports).flatMap((entry) => Object.values(entry)).map((file) => file.replace(/^\.\//, ""));
  const absent = entries.filter((file) => !paths.includes(file));
  const byFolder = new Map<string, [number, number]>();
  for (const { path, size } of report.files) {
    const folder = path.includes("/") ? path.slice(0, path.indexOf("/")) : path;
    const [n, bytes] = byFolder.get(folder) ?? [0, 0];
    byFolder.set(folder, [n + 1, bytes + size]);
  }
  for (const [folder, [n, bytes]] of byFolder) console.log(`  ${folder.padEnd(14)}${String(n).padStart(4)} files ${String(bytes).padStart(9)} B`);
  if (stray.length || absent.length) {
    console.error(`would ship ${stray.join(", ") || "nothing stray"}; would not ship ${absent.join(", ") || "nothing missing"}`);
    process.exit(1);
  }
  console.log(`npm pack --dry-run: ${report.entryCount} files, ${report.size} B packed, ${report.unpackedSize} B unpacked ` +
    `(${(report.unpackedSize / TARGET_BYTES).toFixed(2)} of the 1 MB target)`);
  console.log(`package_files=${report.entryCount}`);
  console.log(`package_tarball_bytes=${report.size}`);
  console.log(`package_bytes=${report.unpackedSize}`);
}

main();
