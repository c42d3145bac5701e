/** The wire types, generated at build from `proto/coveil.proto` by protobuf-es (`npm run generate`). */
export * from "./gen/coveil_pb.js";
