"""Commands that docs/ecosystem.md gives run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from agent_r1.train.data import load_tasks

ROOT = Path(__file__).resolve().parents[1]


def test_the_openenv_rows_command_writes_the_rows_the_config_names(tmp_path):
    docs = (ROOT / "docs" / "ecosystem.md").read_text()
    section = docs[docs.index("## OpenEnv") :]
    command = re.search(r"```bash\npython -c '\n(.*?)\n'\n", section, re.S).group(1)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", command], cwd=tmp_path, env=env, check=True, timeout=120)
    train, test = load_tasks(tmp_path / "gridwalk_train.jsonl"), load_tasks(tmp_path / "gridwalk_test.jsonl")
    assert len(train) == 4000 and len(test) > 0
    assert train[0] == {"id": "train-0-0", "dx": 2, "dy": -5, "budget": 9}  # the row the docs show
    assert '# rows: {"id": "train-0-0", "dx": 2, "dy": -5, "budget": 9}' in section
    assert "train: gridwalk_train.jsonl" in section and "val: gridwalk_test.jsonl" in section
