/** The wire: the types generated at build from `proto/coveil.proto` by protobuf-es (`npm run generate`), and the
 * edge's codec over them.  `FusionMode`, `FusionSpace` and `TokenLogprobs` name the codec's types here (the
 * generated enums and message are `PbFusionMode`, `PbFusionSpace`, `PbTokenLogprobs`). */
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
export type { FusionMode, FusionSpace } from "./session.js";
