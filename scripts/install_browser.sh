#!/usr/bin/env bash
# Install what the browser tests (pytest -m browser) need: Debian's chromium and Playwright for Python.
# Playwright's PyPI wheel bundles its driver; we never run `playwright install` (it downloads its own
# browser builds): the tests launch /usr/bin/chromium through `executable_path`.
#   bash scripts/install_browser.sh        # needs root (apt-get) and the project's .venv
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
if ! command -v chromium >/dev/null 2>&1 || ! fc-list 2>/dev/null | grep -qi dejavu; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
fi
"$PYTHON" -c "import playwright" 2>/dev/null || "$PYTHON" -m pip install -q playwright
echo "browser test tools: $(chromium --version 2>/dev/null || echo 'chromium missing'); playwright $("$PYTHON" -m pip show playwright 2>/dev/null | sed -n 's/^Version: //p')"
