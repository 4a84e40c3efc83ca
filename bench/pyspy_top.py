"""Where a py-spy raw profile's samples go, per process and thread: each frame's inclusive sample count.

py-spy's `record --format raw` writes one line per distinct stack ("frame;frame;... count"), the processes (with
--subprocesses: a child's under its parent's) and thread (with --threads) as its first frames. This prints, for each
innermost process (and thread), its samples and its most frequent frames, so a profile of the server's decode steps
(`bash bench/device_kv8.sh serve-profile`) says how much of each process's time is a wait (with --idle) and where
the rest goes.

    python bench/pyspy_top.py serve-profile.txt                 # every root, 25 frames each
    python bench/pyspy_top.py serve-profile.txt --match SlotDriver._run --top 40   # frames under one function
"""
from __future__ import annotations

import argparse
import collections
import sys


def read(path: str) -> list[tuple[list[str], int]]:
    out = []
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if stack and n.isdigit():
                frames, parts = [], stack.split(";")
                while parts:  # a process frame is `process N:"cmdline"`, and a cmdline may hold ";"
                    f = parts.pop(0)
                    while f.startswith("process ") and not f.endswith('"') and parts:
                        f += ";" + parts.pop(0)
                    frames.append(f)
                out.append((frames, int(n)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw", help="py-spy record --format raw output")
    ap.add_argument("--top", type=int, default=25, help="frames shown per root")
    ap.add_argument("--match", default="", help="only stacks through a frame containing this; frames counted from it")
    a = ap.parse_args()
    roots: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    for frames, n in read(a.raw):
        lead = 0
        while lead < len(frames) and frames[lead].startswith(("process ", "thread ")):
            lead += 1
        root = ";".join(f for f in frames[:lead] if f.startswith("thread ")
                        or f == [g for g in frames[:lead] if g.startswith("process ")][-1])
        frames = frames[lead:]
        if a.match:
            at = next((i for i, f in enumerate(frames) if a.match in f), None)
            if at is None:
                continue
            frames = frames[at:]
        totals[root] += n
        for f in set(frames):
            roots[root][f] += n
    for root, total in totals.most_common():
        print(f"\n{root[:150]}: {total} samples")
        for f, n in roots[root].most_common(a.top):
            print(f"  {n:7d} {100 * n / total:5.1f}%  {f[:140]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
