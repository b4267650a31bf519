"""Where a process spent its time, from the periodic stack dumps of
time_first_start.py --stacks (in faulthandler's format): for the thread that ran
the engine (the main thread), how many dumps each frame was
on the stack in, and the innermost frames most seen. Each dump is one sample
of --stack-every seconds. Usage:
  python3 benchmarks/gpu/stack_summary.py OUT/warm/stacks.txt [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import re

FRAME = re.compile(r'\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def samples(text: str) -> list[list[str]]:
    """The main thread's stack in each dump (the thread whose outermost frame is
    a module's top level), innermost frame first."""
    out = []
    for dump in text.split("Timeout (")[1:]:
        for block in dump.split("\nThread 0x")[1:]:
            frames = [m for m in map(FRAME.match, block.splitlines()) if m]
            if frames and frames[-1]["func"] == "<module>":
                out.append([f'{"/".join(m["file"].split("/")[-2:])}:{m["line"]} {m["func"]}'
                            for m in frames])
                break
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("stacks")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    stacks = samples(open(a.stacks, errors="replace").read())
    on_stack, innermost = collections.Counter(), collections.Counter()
    for frames in stacks:
        innermost[frames[0]] += 1
        for f in set(frames):
            on_stack[f] += 1
    print(f"{len(stacks)} samples")
    print("innermost frames:")
    for f, n in innermost.most_common(a.top):
        print(f"  {n:5d}  {f}")
    print("frames on the stack (inclusive):")
    for f, n in on_stack.most_common(a.top):
        print(f"  {n:5d}  {f}")


if __name__ == "__main__":
    main()
