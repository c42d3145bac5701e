/** The wire: the types generated at build from `proto/coveil.proto` by protobuf-es (`npm run generate`), and the
 * edge's codec over them.  `TokenLogprobs` names the codec's type here (the generated message is
 * `PbTokenLogprobs`; the generated enums are also `PbFusionMode`, `PbFusionSpace`). */
export * from "./gen/coveil_pb.js";
export {
  FusionMode as PbFusionMode,
  FusionSpace as PbFusionSpace,
  type TokenLogprobs as PbTokenLogprobs,
} from "./gen/coveil_pb.js";
export * from "./bytes.js";
export * from "./codec.js";
export type { TokenLogprobs } from "./codec.js";
export * from "./distribution.js";
export * from "./session.js";
