"""`harvest sae features serve DIR`: the site over local HTTP, for a browser that will not open file:// pages
(or another machine on a tunnel). The site needs no server: any static file server does what this one does."""

from __future__ import annotations

import functools
import os
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

from harvest.errors import UserError


def serve(directory: str, port: int = 8000, host: str = "127.0.0.1") -> None:
    """Serve `directory` (a site `harvest sae features` wrote) until Ctrl-C, printing its URL."""
    if not os.path.isfile(os.path.join(directory, "index.html")):
        raise UserError(f"{directory}: no index.html there; give the local --out directory of `harvest sae features`")
    handler = functools.partial(SimpleHTTPRequestHandler, directory=os.path.abspath(directory))
    try:
        server = ThreadingHTTPServer((host, port), handler)
    except OSError as e:
        raise UserError(f"cannot serve on {host}:{port}: {e.strerror}; give another --port") from e
    with server:
        shown = f"[{host}]" if ":" in host else host
        print(f"serving {directory} at http://{shown}:{server.server_address[1]}/ (Ctrl-C stops)", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            print("stopped", flush=True)
