/**
 * Optional peer dependencies, loaded where they are used (Node and Electron only: `@coveil/edge/node`), so that an app
 * that does not use one need not install it, and one that does but has not gets `MissingPeerDependencyError` naming
 * the package to install instead of a resolver's error.
 */

import { createRequire } from "node:module";
import { MissingPeerDependencyError } from "./core/errors.js";

const require = createRequire(import.meta.url);

/** `error` as `MissingPeerDependencyError` when it says that `name` itself cannot be found (not a package it needs). */
function missing(error: unknown, name: string, usedBy: string): unknown {
  const { code, message } = error as { code?: unknown; message?: unknown };
  const notFound = code === "MODULE_NOT_FOUND" || code === "ERR_MODULE_NOT_FOUND";
  return notFound && typeof message === "string" && message.includes(`'${name}'`)
    ? new MissingPeerDependencyError(name, usedBy)
    : error;
}

/** The CommonJS package `name` (`require`), for `usedBy` (what needs it, for the message). */
export function requirePeer<T>(name: string, usedBy: string): T {
  try {
    return require(name) as T;
  } catch (error) {
    throw missing(error, name, usedBy);
  }
}

/** The package `name` as `load` imports it (`() => import("name")`, so that its types are known), for `usedBy`. */
export async function importPeer<T>(name: string, usedBy: string, load: () => Promise<T>): Promise<T> {
  try {
    return await load();
  } catch (error) {
    throw missing(error, name, usedBy);
  }
}
