#!/usr/bin/env bash
# Create .venv-verifiers: verifiers 0.4 (Prime Intellect's environments, the v1 API) in a venv of its
# own, for agent-r1's verifiers env (`env.name: verifiers`, docs/ecosystem.md) and its test tier
# (`pytest -m verifiers`).
#   bash scripts/install_verifiers.sh
# Facts this script works around:
# - verifiers pins openai<3 and mcp==2.0.0 while agent-r1's venv has openai 3.x and mcp 2.3, so it
#   cannot share that venv; agent-r1 runs it as a worker process here (agent_r1/envs/ecosystem/
#   verifiers_worker.py) and talks to it over a localhost socket. agent-r1 itself is not installed here.
# - verifiers needs Python >= 3.11.
# - its `null` and `bash` harnesses run a PEP 723 chat program through `uv` (installed here, found on
#   the worker's PATH). uv resolves the program's dependencies (openai, mcp, httpx...) from PyPI when a
#   worker first prepares it, and without a lockfile it asks PyPI again on every later worker start:
#   offline, harness setup then fails. So we prepare the program once now (fetching into uv's cache)
#   and lock it (`uv lock --script`, the lockfile beside verifiers' cached copy of the script under
#   ~/.cache/verifiers); rollouts then need no network. This step runs every time (it is quick once done).
# Skip the pip work when the environment already imports verifiers (rerun with FORCE=1 to reinstall).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VERIFIERS_SPEC=${VERIFIERS_SPEC:-verifiers==0.4.*}
if [ -n "${FORCE:-}" ] || ! { [ -x .venv-verifiers/bin/uv ] && .venv-verifiers/bin/python -c "import verifiers.v1" 2>/dev/null; }; then
    "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "verifiers needs Python >= 3.11; set PYTHON=python3.11 (or newer)")'
    [ -x .venv-verifiers/bin/python ] || "$PYTHON" -m venv .venv-verifiers
    .venv-verifiers/bin/python -m pip install -q --upgrade pip
    .venv-verifiers/bin/python -m pip install -q "$VERIFIERS_SPEC" uv
fi
# Prepare the harnesses' chat program (uv resolves and caches its dependencies), then lock it.
PATH="$PWD/.venv-verifiers/bin:$PATH" .venv-verifiers/bin/python - <<'EOF'
import asyncio
import subprocess

from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes.subprocess import SubprocessConfig, SubprocessRuntime


async def prepare() -> None:
    runtime = SubprocessRuntime(SubprocessConfig())
    await runtime.start()
    try:
        _, script = await runtime.prepare_uv_script(CHAT_PROGRAM_SOURCE, activate=False)
    finally:
        await runtime.stop()
    subprocess.run(["uv", "lock", "--script", script, "--quiet", "--no-config"], check=True)


asyncio.run(prepare())
EOF
echo "verifiers installed in .venv-verifiers ($(.venv-verifiers/bin/python -c 'import verifiers; print("verifiers", verifiers.__version__)'), $(.venv-verifiers/bin/uv --version))"
