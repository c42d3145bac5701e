/** `@coveil/edge`: the CoVeil edge SDK in TypeScript. */
export * from "./core/errors.js";
export * from "./core/fusion.js";
export * from "./core/format.js";
export * from "./core/distribution.js";
export * from "./core/decide.js";
export * from "./policies/index.js";
export * from "./privacy/accounting.js";
export * from "./privacy/accountant.js";
export * from "./privacy/budget.js";
export * from "./privacy/ledger.js";
export * from "./privacy/masking.js";
export * as wire from "./wire/index.js";
