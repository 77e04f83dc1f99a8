"""trainer.retain_freed_memory: glibc keeps freed memory in the process, so a large tensor allocated
again and again stops paying page faults. Each check runs in its own interpreter (the setting is
process-wide and cannot be undone)."""

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent_r1.train.config import config_from_dict

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt"
)


def _huge_pages_always() -> bool:
    """Transparent huge pages for every mapping: faults then come per 2 MiB, not per 4 KiB page."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.is_file() and "[always]" in path.read_text()


# A training step's pattern: activations allocated together (here 10 tensors of 8 MiB, kept alive
# like a forward's for its backward), then all freed. glibc's default serves the first round by mmap,
# then raises its mmap threshold to 8 MiB and its trim threshold to twice that, so later rounds come
# from the heap, but freeing 80 MiB at its top hands the pages back to the kernel and every round
# faults each 4 KiB page again on first touch. Retained memory is reused without a fault.
_FAULTS = textwrap.dedent(
    """
    import resource, sys
    import torch
    from agent_r1.train.config import config_from_dict
    from agent_r1.train.process import apply_process_settings

    apply_process_settings(config_from_dict({"trainer": {"retain_freed_memory": sys.argv[1] == "1"}}).trainer)

    def step():
        activations = [torch.empty(2 << 20).fill_(1.0) for _ in range(10)]
        del activations

    step()  # the first rounds may fault either way
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)

PAGES = 20 * 10 * (8 << 20) // 4096  # the pages the timed rounds write


def _faults(retain: bool) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS, "1" if retain else "0"], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(_huge_pages_always(), reason="the page counts assume 4 KiB faults")
def test_retained_memory_is_reused_without_page_faults():
    default, retained = _faults(False), _faults(True)
    assert default >= PAGES // 2, f"glibc's default should fault on most of the {PAGES} pages: {default}"
    assert retained < PAGES // 10, f"retained memory faulted {retained} times over {PAGES} pages"


def test_the_setting_is_off_by_default_and_the_quickstart_turns_it_on():
    from agent_r1.commands.quickstart import rl_settings

    assert config_from_dict({}).trainer.retain_freed_memory is False
    settings = rl_settings(steps=1, tasks_per_step=1, group_size=2, lr=1e-3, seed=0, run_dir="r", threads=1)
    assert config_from_dict(settings).trainer.retain_freed_memory is True
