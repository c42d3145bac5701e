/**
 * A cloud row as it arrived (Python: `edge_sdk.protocol.wire.CloudDistribution`'s wire fields): the core's
 * {@link CloudDistribution} with the cloud's forward time and, running ahead, the token it assumed.
 */

import { CloudDistribution } from "../core/distribution.js";

export class ReceivedDistribution extends CloudDistribution {
  constructor(
    step: number,
    ids: Int32Array,
    values: Float32Array,
    tailBound: number,
    tailMass: number,
    dense: Float32Array | null,
    /** the cloud's own forward for this row, as it reports it */
    readonly forwardNs = 0,
    /** run-ahead: the token at `step - 1` this row was computed after (`null`: lockstep, or the first step) */
    readonly assumesToken: number | null = null,
  ) {
    super(step, ids, values, tailBound, tailMass, dense);
  }
}
