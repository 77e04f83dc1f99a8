"""docs/tutorial.md is run as written, so the docs cannot rot.

Its fenced blocks are replayed in order in an empty folder: a block whose first line is
``# file: NAME`` is saved as ``NAME``; every line of a ``bash`` block is run there by bash, with this
interpreter's ``bin`` folder first on ``PATH`` (``python`` and ``agent-r1`` are the installed ones).
``pip install`` lines are the one exception: the suite runs where agent-r1 is already installed and
has no network, so they are checked to name the package and not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "tutorial.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
FILE_MARK = re.compile(r"^# file: (\S+)\n")


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def test_the_tutorial_parses_into_files_and_commands() -> None:
    found = blocks(TUTORIAL.read_text())
    files = [FILE_MARK.match(body).group(1) for _, body in found if FILE_MARK.match(body)]
    commands = [line for lang, body in found if lang == "bash" for line in body.splitlines() if line]
    assert files == ["maze_env.py", "warm_start.py", "maze.yaml", "results.py"]
    assert commands[0] == "pip install agent-r1"
    assert "PYTHONPATH=. agent-r1 train maze.yaml" in commands
    # Every block is either a file or commands: nothing shown is left unexecuted.
    assert all(lang == "bash" or FILE_MARK.match(body) for lang, body in found)


def test_the_tutorial_runs_from_a_fresh_folder(tmp_path) -> None:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    env.pop("PYTHONPATH", None)  # the tutorial sets what it needs
    transcript = []
    for lang, body in blocks(TUTORIAL.read_text()):
        mark = FILE_MARK.match(body)
        if mark:
            (tmp_path / mark.group(1)).write_text(body[mark.end() :])
            continue
        assert lang == "bash", f"a {lang!r} block that is neither a file nor commands"
        for line in filter(None, body.splitlines()):
            if line.startswith("pip install"):
                continue
            done = subprocess.run(
                ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
            )
            transcript.append(f"$ {line}\n{done.stdout}{done.stderr}")
            assert done.returncode == 0, "\n".join(transcript)
    log = "\n".join(transcript)
    assert "SFT loss" in log and "done: 3 steps in runs/maze" in log
    assert "held-out success by step: [(0, " in log
    # No transformers progress bars on the console (agent_r1.models.loading.quiet_progress_bars).
    assert "Loading weights" not in log and "Writing model shards" not in log
    assert (tmp_path / "runs" / "maze" / "checkpoints").is_dir()
