import { defineConfig } from "vite";

// the page and its assets (wllama's .wasm) into dist/, loaded from the same origin
export default defineConfig({ root: import.meta.dirname, base: "./", build: { outDir: "dist", emptyOutDir: true, target: "es2022" } });
