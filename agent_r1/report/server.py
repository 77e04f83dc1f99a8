"""``agent-r1 view``: serve a run's report page on localhost, rebuilt from the run directory on every
request, so reloading the page shows the newest metrics and trajectory dumps of a run in progress.

With ``api_key`` every request needs the key, as ``Authorization: Bearer KEY`` or, for a browser,
``?key=KEY`` in the page's address; anything else is answered 401."""

from __future__ import annotations

import hashlib
import hmac
import re
import sys
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

from agent_r1.report.html import render_html
from agent_r1.report.run import load_run

__all__ = ["make_server", "serve"]


_KEY_IN_QUERY = re.compile(r"([?&]key=)[^&\s]*")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def make_server(
    run_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    last_steps: int = 5,
    per_step: int = 32,
    api_key: str | None = None,
) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) whose ``/`` is the report of ``run_dir``; port 0 picks a free one.
    ``api_key``: every request must carry it (``Authorization: Bearer KEY`` or ``?key=KEY``)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist (or is not a directory)")
    if last_steps < 0 or per_step < 0:
        raise ValueError(f"last_steps and per_step must be >= 0 (0 = all), got {last_steps}, {per_step}")
    if api_key is not None and not api_key:
        raise ValueError("the API key is empty; give a non-empty key, or none")
    expected = _digest(api_key) if api_key else None

    class Handler(BaseHTTPRequestHandler):
        def _authorized(self) -> bool:
            if expected is None:
                return True
            header = self.headers.get("Authorization", "")
            given = [header[len("Bearer ") :]] if header.startswith("Bearer ") else []
            given += parse_qs(self.path.partition("?")[2]).get("key", [])
            return any(hmac.compare_digest(_digest(key), expected) for key in given)

        def do_GET(self) -> None:
            if not self._authorized():
                self.send_error(HTTPStatus.UNAUTHORIZED, "invalid or missing key (?key=KEY or Bearer)")
                return
            if self.path.split("?", 1)[0] not in ("/", "/index.html"):
                self.send_error(HTTPStatus.NOT_FOUND, "only / is served: the report page")
                return
            try:
                page = render_html(load_run(run_dir, last_steps=last_steps, per_step=per_step))
            except (OSError, ValueError) as e:
                self.send_error(HTTPStatus.INTERNAL_SERVER_ERROR, f"cannot read the run: {e}")
                return
            body = page.encode("utf-8")
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            line = _KEY_IN_QUERY.sub(r"\1***", format % args)  # the request line may carry ?key=KEY
            sys.stderr.write(f"agent-r1 view: {self.address_string()} {line}\n")

    return ThreadingHTTPServer((host, port), Handler)


def serve(
    run_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    last_steps: int = 5,
    per_step: int = 32,
    on_ready: Callable[[str], None] = print,
    api_key: str | None = None,
) -> None:
    """Serve the report of ``run_dir`` until interrupted; ``on_ready`` receives the page's URL."""
    server = make_server(
        run_dir, host=host, port=port, last_steps=last_steps, per_step=per_step, api_key=api_key
    )
    bound_host, bound_port = server.server_address[:2]
    on_ready(f"http://{bound_host}:{bound_port}/")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
