"""What both ends of a session must agree on, byte for byte: the protocol of ``proto/coveil.proto``.

* :mod:`~edge_sdk.protocol.signals`: what a step's decision sends (``CloudUpload``, ``SyncedToken``);
* :mod:`~edge_sdk.protocol.wire`: the codec (typed values <-> protobuf messages), padding, ``step_exposure``;
* :mod:`~edge_sdk.protocol.status`: :class:`~edge_sdk.protocol.status.CloudError`, the one error of a session;
* :mod:`~edge_sdk.protocol.connection`: :class:`~edge_sdk.protocol.connection.CloudConnection`, the edge's view
  of one session;
* :mod:`~edge_sdk.protocol.channels`: :class:`~edge_sdk.protocol.channels.MessageChannel`, the carrier
  contract, and the in-process and gRPC carriers; :mod:`~edge_sdk.protocol.websocket`, the WebSocket carrier.

The cloud's pick rule lives beside the rest of the fusion math (:func:`edge_sdk.fusion.cloud_scores`).  Nothing
here imports the policies or the decoding loop (``tests/test_packaging.py``).
"""
