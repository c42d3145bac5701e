/** `@coveil/edge`: the CoVeil edge SDK in TypeScript. */
export * from "./core/errors.js";
export * as wire from "./wire/index.js";
