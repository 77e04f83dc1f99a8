"""trainer.retain_freed_memory: glibc keeps freed memory in the process, so a large tensor allocated
again and again stops paying page faults. Each check runs in its own interpreter (the setting is
process-wide and cannot be undone)."""

import os
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


def _glibc_has_mallinfo2() -> bool:
    version = tuple(int(part) for part in platform.libc_ver()[1].split(".")[:2] if part.isdigit())
    return version >= (2, 33)


# A tensor one MiB larger each round, 2 to 31 MiB, freed before the next. By glibc's rule each is a
# fresh mapping under its default: an allocation above the mmap threshold is mmapped and unmapped
# when freed, and the threshold only rises to the size of the largest block freed, which the next
# round exceeds. So every round faults each of its 4 KiB pages again on first touch. Retained memory
# (threshold 32 MiB, no trimming) serves every round from the heap, and only the heap's growth to
# the largest tensor (and the gaps small live blocks leave) faults. The child reports the rounds
# glibc served by mmap and those whose free shrank the heap (mallinfo2: glibc's own accounting,
# whatever the kernel does), then the page faults. Transparent huge pages are turned off for the
# child (prctl PR_SET_THP_DISABLE): a kernel that backs mappings with 2 MiB pages faults per 2 MiB.
#
# (The test this replaces counted faults of 10 x 8 MiB tensors freed together, which glibc's default
# gives back only when they sit at the heap's top. On one CI machine its default faulted 2048 times,
# not ~400k: the count it also gives here when a 64 MiB tensor is allocated and freed first, so most
# likely a different heap layout, not a different glibc.)
_FAULTS = textwrap.dedent(
    """
    import ctypes, resource, sys
    import torch

    libc = ctypes.CDLL(None)
    libc.prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
        )]

    libc.mallinfo2.restype = MallInfo2

    from agent_r1.train.config import config_from_dict
    from agent_r1.train.process import apply_process_settings

    apply_process_settings(config_from_dict({"trainer": {"retain_freed_memory": sys.argv[1] == "1"}}).trainer)

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    before, mapped, trimmed = faults(), 0, 0
    for mib in range(2, 32):
        outside = libc.mallinfo2().hblkhd
        tensor = torch.empty(mib << 18).fill_(1.0)
        mapped += libc.mallinfo2().hblkhd - outside >= mib << 20
        heap = libc.mallinfo2().arena
        del tensor
        trimmed += libc.mallinfo2().arena < heap
    print(mapped, trimmed, faults() - before)
    """
)

ROUNDS = 30
PAGES = sum(range(2, 32)) * (1 << 20) // 4096  # the pages the rounds write: 126,720


def _run(retain: bool) -> tuple[int, int, int]:
    """(rounds served by a fresh mapping, rounds whose free shrank the heap, page faults) under
    glibc's default or retained memory; the default: no MALLOC_*, GLIBC_TUNABLES or LD_PRELOAD."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")
    }
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS, "1" if retain else "0"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    mapped, trimmed, faults = out.stdout.split()[-3:]
    return int(mapped), int(trimmed), int(faults)


def _machine() -> str:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return (
        f"glibc {platform.libc_ver()[1]}, kernel {platform.release()}, "
        f"THP {thp.read_text().strip() if thp.is_file() else 'unreadable'}"
    )


@pytest.mark.skipif(not _glibc_has_mallinfo2(), reason="mallinfo2 needs glibc 2.33")
def test_retained_memory_is_served_from_the_heap_and_reused_without_page_faults():
    default_mapped, _, default_faults = _run(False)
    retained_mapped, retained_trimmed, retained_faults = _run(True)
    # glibc's rules, whatever the kernel: by default every round is a fresh mapping (less any below a
    # threshold the interpreter's start-up already raised: none here); retained, none is, and no free
    # gives the heap back (a trim needs the freed block at the heap's top, so a broken trim setting
    # shows here only in some heap layouts; a broken threshold shows in the mmap count always).
    assert default_mapped >= ROUNDS // 2, (
        f"glibc's default mmapped {default_mapped} of {ROUNDS} rounds ({_machine()})"
    )
    assert retained_mapped == 0, f"retained memory still mmapped {retained_mapped} of {ROUNDS} rounds"
    assert retained_trimmed == 0, f"retained memory's heap shrank after {retained_trimmed} of {ROUNDS} frees"
    if default_faults < PAGES // 2:
        pytest.skip(
            f"{ROUNDS} fresh mappings of {PAGES} 4 KiB pages faulted {default_faults} times here ({_machine()}): "
            "the kernel maps more than a page per fault, so the fault counts cannot tell reuse apart"
        )
    # Reuse faults the heap's growth: the largest tensor, plus the gaps the interpreter's own small
    # live blocks split off between rounds (here ~15.6k pages: every other round starts above one).
    # A fresh mapping every round faults every page: 126.7k.
    assert retained_faults < PAGES // 4, (
        f"retained memory faulted {retained_faults} times over {PAGES} pages ({_machine()})"
    )


def test_the_setting_is_off_by_default_and_the_quickstart_turns_it_on():
    from agent_r1.commands.quickstart import rl_settings

    assert config_from_dict({}).trainer.retain_freed_memory is False
    settings = rl_settings(steps=1, tasks_per_step=1, group_size=2, lr=1e-3, seed=0, run_dir="r", threads=1)
    assert config_from_dict(settings).trainer.retain_freed_memory is True


def test_torch_threads_are_set_only_when_the_count_changes(monkeypatch):
    """``set_torch_threads`` leaves torch alone at the count it runs: ``torch.set_num_threads`` also
    turns MKL's dynamic threading off, which made CPU flash attention several times slower at the
    same count (agent_r1.train.process)."""
    import torch

    from agent_r1.train.process import set_torch_threads

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)  # a recording double
    now = torch.get_num_threads()
    set_torch_threads(now)
    set_torch_threads(now + 1)
    assert calls == [now + 1]
