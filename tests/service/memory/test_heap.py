"""kvtag_store.heap: free pages in the middle of the heap go back to the system after a forgetting
sweep, in a separate process so the suite's own heap does not blur the figure."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
from kvtag_store import heap

def anon_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1])

# 64 MiB of 2 KiB values (past pymalloc, so glibc's heap), every 64th kept: the survivors pin the
# heap's top, so only a trim of the middle can give the rest back.
values = [bytes(2048) for _ in range(32768)]
kept = values[::64]
del values
before = anon_kib()
returned = heap.give_back()
print(returned, before, anon_kib())
"""


def test_free_pages_in_the_middle_of_the_heap_are_given_back() -> None:
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True)
    returned, before, after = out.stdout.split()
    assert returned == "True"
    assert int(before) - int(after) > 32 * 1024, f"RssAnon {before} -> {after} KiB"


CYCLES = """
import gc
from kvtag_store import heap

def anon_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1])

gc.disable()  # as if the collector's next full pass were far off
before = anon_kib()
pairs = []
for _ in range(100_000):  # small objects in reference cycles: pymalloc's arenas, ~40 MiB
    a, b = [], []
    a.append(b)
    b.append(a)
    pairs.append(a)
del pairs, a, b
grown = anon_kib()
heap.give_back()
print(before, grown, anon_kib())
"""


def test_giving_back_collects_the_cycles_that_keep_interpreter_arenas_mapped() -> None:
    out = subprocess.run([sys.executable, "-c", CYCLES], capture_output=True, text=True, check=True)
    before, grown, after = (int(v) for v in out.stdout.split())
    assert grown - before > 10_000, "the cycles should have taken >10 MiB"
    assert after - before < (grown - before) / 4, (before, grown, after)
