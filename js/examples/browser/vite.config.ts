import { readFileSync } from "node:fs";
import { join } from "node:path";
import { defineConfig } from "vite";

// `@coveil/edge` and its subpaths resolve as an app that installed the package resolves them: through the package's
// `exports`, to the built dist/ (`npm run build` first)
const packageRoot = join(import.meta.dirname, "..", "..");
const { name, exports } = JSON.parse(readFileSync(join(packageRoot, "package.json"), "utf8")) as {
  name: string; exports: Record<string, { import: string }>;
};
const alias = Object.entries(exports).map(([subpath, { import: file }]) => ({
  find: new RegExp(`^${(name + subpath.slice(1)).replaceAll("/", "\\/")}$`),
  replacement: join(packageRoot, file),
}));

// the page and its assets (wllama's .wasm) into dist/, loaded from the same origin
export default defineConfig({
  root: import.meta.dirname, base: "./", resolve: { alias }, build: { outDir: "dist", emptyOutDir: true, target: "es2022" },
});
