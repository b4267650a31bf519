"""retain_freed_memory: freed activations are reused, not faulted in again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# A layer's worth of activations, held together and freed, over and over: the
# pattern of a CPU engine step. Prints the page faults of all the repeats. The
# blocks are 40 MiB, past glibc's largest dynamic mmap threshold (32 MiB), so
# that without the settings every block is a fresh mmap whatever glibc learned
# from earlier frees: the baseline faults every repeat, not only some.
_LOOP = textwrap.dedent("""
    import resource, sys, torch
    if sys.argv[1] == "retain":
        from replica_worker.engine.host_memory import retain_freed_memory
        assert retain_freed_memory()
    x = torch.randn(10240, 1024)
    def layer():
        return [x * 2 for _ in range(3)]  # 120 MiB live at once, then freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(12):
        layer()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _page_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _LOOP, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_activations_are_reused_without_page_faults():
    default, retained = _page_faults("default"), _page_faults("retain")
    pages_a_repeat = 120 << 8
    # glibc alone unmaps every freed block and faults it in again: all 12 repeats.
    assert default > 10 * pages_a_repeat, (default, retained)
    # Retained, the heap grows to its working size and is then reused. Small
    # allocations landing between the large blocks make it grow by a block or
    # two more over the first repeats (seen: 1 to 3 repeats' worth in all);
    # never anything like one fault per repeat.
    assert retained < 4 * pages_a_repeat, (default, retained)
