"""Generated wire code (``coveil_pb2``, ``coveil_pb2_grpc``), built from ``proto/coveil.proto``."""
