/** Loading optional peers (src/peer.ts): a missing one is named; any other failure is left as it is. */

import { describe, expect, it } from "vitest";
import { MissingPeerDependencyError } from "../src/core/errors.js";
import { importPeer, requirePeer } from "../src/peer.js";

const ABSENT = "coveil-test-absent-package"; // installed nowhere

describe("optional peers", () => {
  it("a package that is installed is returned", async () => {
    const ws = requirePeer<{ OPEN: number }>("ws", "the test");
    expect(ws.OPEN).toBe(1);
    const llama = await importPeer("node-llama-cpp", "the test", () => import("node-llama-cpp"));
    expect(typeof llama.getLlama).toBe("function");
  });

  it("one that is not is MissingPeerDependencyError naming it and what needs it (require and import)", async () => {
    const message = `the test needs the package ${ABSENT}, an optional peer dependency of @coveil/edge that is not ` +
      `installed: npm install ${ABSENT}`;
    expect(() => requirePeer(ABSENT, "the test")).toThrow(MissingPeerDependencyError);
    expect(() => requirePeer(ABSENT, "the test")).toThrow(message);
    const name: string = ABSENT;
    const error = await importPeer(name, "the test", () => import(name)).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(MissingPeerDependencyError);
    expect(error).toMatchObject({ code: "FAILED_PRECONDITION", packageName: ABSENT, message });
  });

  it("a missing module other than the peer itself is not reported as the peer missing", async () => {
    const name: string = ABSENT;
    const error = await importPeer("ws", "the test", () => import(name)).catch((e: unknown) => e);
    expect(error).not.toBeInstanceOf(MissingPeerDependencyError);
    expect((error as { code?: string }).code).toBe("ERR_MODULE_NOT_FOUND");
  });
});
