"""Top frames of a py-spy profile in raw (collapsed) form, by inclusive and by
self time. A frame is a function in a file (line numbers merged).

    python -m benchmarks.router.profile_top PROFILE.txt [--top 25]

Shares are of the samples py-spy kept: by default it drops idle samples (a
thread blocked in epoll or a lock), so the shares are of the time the router's
threads were doing something, or were runnable and waiting for a core. With
`py-spy record --threads` each stack starts with its thread; --thread NAME
keeps one thread's stacks (MainThread: the event loop).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

_FRAME = re.compile(r"^(?P<name>.*?) \((?P<file>.*?)(?::\d+)?\)$")
_PREFIXES = ("site-packages/", "lib/python3")


def frame_key(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    path = m.group("file")
    for marker in _PREFIXES:
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    else:
        path = path.split("/wt/", 1)[-1]
    return f"{m.group('name')} ({path})"


def read_stacks(path: str) -> list[tuple[list[str], int]]:
    stacks = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            stacks.append(([frame_key(x) for x in stack.split(";")], int(count)))
    return stacks


def thread_shares(stacks) -> dict[str, float]:
    """Samples per thread (the first frame under --threads), as shares of all."""
    per = Counter()
    for frames, n in stacks:
        per[frames[0] if frames[0].startswith("thread (") else "(no thread frame)"] += n
    total = max(1, sum(per.values()))
    return {k: round(v / total, 4) for k, v in per.most_common()}


def top_frames(path: str, top: int = 25, thread: str | None = None) -> dict:
    stacks = read_stacks(path)
    threads = thread_shares(stacks)
    if thread:
        stacks = [(f, n) for f, n in stacks if f[0].startswith("thread (") and f[0].endswith(thread)]
    total = sum(n for _, n in stacks)
    inclusive, own = Counter(), Counter()
    for frames, n in stacks:
        for key in set(frames):
            inclusive[key] += n
        own[frames[-1]] += n

    def share(counter):
        return [{"frame": k, "share": round(v / max(1, total), 4)} for k, v in counter.most_common(top)]

    return {"samples": total, "thread": thread, "threads": threads,
            "inclusive": share(inclusive), "self": share(own)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--thread", help="only this thread's stacks (its name, e.g. MainThread)")
    a = p.parse_args(argv)
    result = top_frames(a.profile, a.top, a.thread)
    print(f"{result['samples']} samples" + (f" of {a.thread}" if a.thread else ""))
    for name, share in result["threads"].items():
        print(f"  {share:6.1%}  {name}")
    for kind in ("inclusive", "self"):
        print(f"\n{kind}:")
        for row in result[kind]:
            print(f"  {row['share']:6.1%}  {row['frame']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
