"""retain_freed_memory: freed activations are reused, not faulted in again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# A layer's worth of activations, held together and freed, over and over: the
# pattern of a CPU engine step. Prints the page faults of the repeats.
_LOOP = textwrap.dedent("""
    import resource, sys, torch
    if sys.argv[1] == "retain":
        from replica_worker.engine.host_memory import retain_freed_memory
        assert retain_freed_memory()
    x = torch.randn(2048, 1024)
    def layer():
        return [x * 2 for _ in range(6)]  # 48 MiB live at once, then freed
    layer()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        layer()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _page_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _LOOP, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_activations_are_reused_without_page_faults():
    default, retained = _page_faults("default"), _page_faults("retain")
    # glibc alone hands much of the freed 48 MiB back and faults it in again
    # (12,288 pages a repeat when all of it goes; how much goes varies from
    # run to run); retained, the repeats reuse it.
    pages_a_repeat = 48 << 8
    assert retained < 8 * pages_a_repeat / 4, (default, retained)
    assert default > 2 * retained, (default, retained)
