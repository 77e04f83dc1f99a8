#!/usr/bin/env bash
# Create .venv and install agent-r1 into it.
#   bash scripts/install.sh          # the package (CPU build of torch)
#   bash scripts/install.sh --dev    # plus the test tools
# TORCH_SPEC chooses the torch build deliberately: the default pins the CPU wheel this project is
# tested with; on a GPU machine use e.g. TORCH_SPEC="torch" (a CUDA build from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "$TORCH_SPEC"
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
.venv/bin/python -m pip install -q -e ".$extras"
echo "agent-r1 installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
