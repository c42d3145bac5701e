"""A ``socketserver`` HTTP server served from a daemon thread for the length of a block."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from socketserver import BaseServer

#: how often ``serve_forever`` looks for a shutdown: ``shutdown()`` waits up to this long (the default's 0.5 s,
#: once per server, was a third of the construction tests' time)
POLL_S = 0.02


@contextmanager
def serving_in_thread(server: BaseServer) -> Iterator[BaseServer]:
    """Serve ``server`` until the block ends, then stop it and close its socket."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": POLL_S}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
