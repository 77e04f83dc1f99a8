"""Look at a run: ``write_report(run_dir)`` writes one self-contained HTML page (training curves,
evaluation table, trajectory viewer, resolved config); ``serve(run_dir)`` serves it, rebuilt on every
reload. Command line: ``agent-r1 report RUN_DIR`` and ``agent-r1 view RUN_DIR``; see docs/report.md."""

from agent_r1.report.html import render_html, write_report
from agent_r1.report.run import RunData, load_run
from agent_r1.report.server import serve

__all__ = ["RunData", "load_run", "render_html", "serve", "write_report"]
