"""``agent-r1 view``: serve a run's report page on localhost, rebuilt from the run directory on every
request, so reloading the page shows the newest metrics and trajectory dumps of a run in progress."""

from __future__ import annotations

import sys
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from agent_r1.report.html import render_html
from agent_r1.report.run import load_run

__all__ = ["make_server", "serve"]


def make_server(
    run_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8000, last_steps: int = 5, per_step: int = 32
) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) whose ``/`` is the report of ``run_dir``; port 0 picks a free one."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist (or is not a directory)")
    if last_steps < 0 or per_step < 0:
        raise ValueError(f"last_steps and per_step must be >= 0 (0 = all), got {last_steps}, {per_step}")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
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
            sys.stderr.write(f"agent-r1 view: {self.address_string()} {format % args}\n")

    return ThreadingHTTPServer((host, port), Handler)


def serve(
    run_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    last_steps: int = 5,
    per_step: int = 32,
    on_ready: Callable[[str], None] = print,
) -> None:
    """Serve the report of ``run_dir`` until interrupted; ``on_ready`` receives the page's URL."""
    server = make_server(run_dir, host=host, port=port, last_steps=last_steps, per_step=per_step)
    bound_host, bound_port = server.server_address[:2]
    on_ready(f"http://{bound_host}:{bound_port}/")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
