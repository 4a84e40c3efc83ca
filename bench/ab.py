"""A/B of the seed's change: depth 0 (the old join) against depth 1 (one chunk in flight below).

Arms alternate (0, 1, 0, 1, ...) in one process, fresh stages per run, same prompt and model.
Prints tok/s per run, the ratio of means, the busy histogram, each stage's own work and
waits, and whether the residual md5 is identical across all runs.

    python bench/ab.py --model smollm2 --stages 2 --threads 1 --tokens 4096 --chunk 256
    python bench/ab.py --model synthetic:llama-3-8b --devices cuda:0,cuda:0 --dtype bfloat16 ...

Across hosts: `--hosts local,gpu2 --listen 10.0.0.5` (rig `stages[i].host`, `listen`; remote stages
start through `--remote-command`, default ssh). `--netns` (root, Linux) runs the same A/B with every
stage on a "host" of its own on this machine: the head and stage 0 in one network namespace, each
other stage in another, joined by a bridge (strata/comm/netns.py); boundaries go over tcp + CurveZMQ.

    sudo python bench/ab.py --netns --model smollm2 --stages 2 --threads 1 --tokens 4096 --chunk 256
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.head.pipeline import Pipeline  # noqa: E402


class NvmlSampler:
    """Samples each GPU's utilization once a second in a thread; histogram of how many are busy."""

    def __init__(self, devices: list[str]):
        import threading

        import pynvml
        pynvml.nvmlInit()
        idx = sorted({int(d.split(":")[1]) for d in devices if d.startswith("cuda")})
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in idx]
        self.samples: list[int] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        import pynvml
        while not self.stopped.wait(1.0):
            self.samples.append(sum(pynvml.nvmlDeviceGetUtilizationRates(h).gpu >= 50 for h in self.handles))

    def stop(self) -> dict:
        self.stopped.set()
        self.thread.join()
        n = max(1, len(self.samples))
        c = [sum(1 for s in self.samples if s == k) for k in range(4)]
        c[3] = sum(1 for s in self.samples if s >= 3)
        return {"none": c[0] / n, "one": c[1] / n, "two": c[2] / n, "three_plus": c[3] / n, "samples": len(self.samples)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--stages", type=int, default=2, help="CPU stages (ignored with --devices)")
    ap.add_argument("--threads", type=int, default=1, help="threads per CPU stage")
    ap.add_argument("--devices", help="comma-separated devices, one stage each (e.g. cuda:0,cuda:0)")
    ap.add_argument("--split", help="comma-separated layer counts (default: auto)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--dynamic", action="store_true", help="dynamic chunk sizes")
    ap.add_argument("--runs", type=int, default=2, help="runs per arm")
    ap.add_argument("--no-perplexity", action="store_true")
    ap.add_argument("--nvml", action="store_true", help="also sample GPU utilization every second (NVML)")
    ap.add_argument("--json", help="write all reports here")
    ap.add_argument("--out", help="run directories under here (default: a temp dir)")
    ap.add_argument("--hosts", help="comma-separated host per stage (local = this machine); needs --listen")
    ap.add_argument("--listen", help="address the head listens on when a stage is remote (rig `listen`)")
    ap.add_argument("--remote-command", help="rig `remote_command` (default: ssh {host} ...)")
    ap.add_argument("--netns", action="store_true", help="each stage in a network namespace of its own on this "
                    "machine (the head with stage 0); needs root and iproute2")
    a = ap.parse_args()
    if a.netns:
        return in_namespaces(a)

    if a.devices:
        stages = [{"device": d} for d in a.devices.split(",")]
    else:
        stages = [{"device": "cpu", "threads": a.threads} for _ in range(a.stages)]
    base = dict(model=a.model, dtype=a.dtype, stages=stages, chunk=a.chunk, dynamic_chunks=a.dynamic,
                prompt={"random": {"tokens": a.tokens, "seed": 0}}, dump_residual=True, timing=True,
                progress=False, perplexity=not a.no_perplexity, generate=0)
    if a.split:
        base["layer_split"] = [int(x) for x in a.split.split(",")]
    if a.hosts:
        for st, h in zip(stages, a.hosts.split(",")):
            st["host"] = h
        base.update(listen=a.listen)
        if a.remote_command:
            base["remote_command"] = a.remote_command
    root = Path(a.out or tempfile.mkdtemp(prefix="strata-ab-"))
    reports = []
    for r in range(a.runs):
        for depth in (0, 1):
            cfg = dict(base, depth=depth)
            with Pipeline(cfg, out=root / f"run{r}-depth{depth}", console=False) as p:
                p.start()
                sampler = NvmlSampler(sorted({s.device for s in p.plan.stages})) if a.nvml else None
                rep = p.prefill().report
                if sampler:
                    rep["busy_nvml"] = sampler.stop()
            rep["run"] = r
            reports.append(rep)
            print(f"run {r} depth {depth}: {rep['tok_s']:,.1f} tok/s  ({rep['seconds']:.2f} s, "
                  f"md5 {rep['residual_md5'][:12]})", flush=True)
            Path(rep["residual_file"]).unlink()  # md5 kept; the dump can be large
    rep0 = [x for x in reports if x["depth"] == 0]
    rep1 = [x for x in reports if x["depth"] == 1]
    m0 = statistics.mean(x["tok_s"] for x in rep0)
    m1 = statistics.mean(x["tok_s"] for x in rep1)
    first = reports[0]
    n = len(first["stages"])
    print()
    print(f"model {a.model} {a.dtype}, {n} stages {[s['device'] for s in first['stages']]}, layers "
          f"{[s['layers'] for s in first['stages']]}, {first['tokens']:,} tokens, {first['chunks']} chunks "
          f"(chunk {a.chunk}{', dynamic' if a.dynamic else ''})")
    print(f"{'arm':<8}" + "".join(f"{'run ' + str(x['run']):>12}" for x in rep0) + f"{'mean':>12}")
    print(f"{'depth 0':<8}" + "".join(f"{x['tok_s']:>12,.1f}" for x in rep0) + f"{m0:>12,.1f}")
    print(f"{'depth 1':<8}" + "".join(f"{x['tok_s']:>12,.1f}" for x in rep1) + f"{m1:>12,.1f}")
    c = first["chunks"]
    print(f"ratio depth1/depth0: {m1 / m0:.2f}x   (balanced ideal N*C/(C+N-1) = {n * c / (c + n - 1):.2f}x)")
    for name, rs in (("depth 0", rep0), ("depth 1", rep1)):
        b = {k: statistics.mean(x["busy"][k] for x in rs) for k in ("one", "two", "three_plus", "none")}
        print(f"busy {name}: one {b['one']:.0%}  two {b['two']:.0%}  three+ {b['three_plus']:.0%}  "
              f"none {b['none']:.0%}   (exact intervals)")
        if all("busy_nvml" in x for x in rs):
            b = {k: statistics.mean(x["busy_nvml"][k] for x in rs) for k in ("one", "two", "three_plus", "none")}
            print(f"busy {name}: one {b['one']:.0%}  two {b['two']:.0%}  three+ {b['three_plus']:.0%}  "
                  f"none {b['none']:.0%}   (1 s NVML samples, GPU busy = utilization >= 50%)")
    print(f"{'stage':>5} {'device':<8} {'layers':<8} {'work d0':>9} {'work d1':>9} {'handoff d0':>11} "
          f"{'handoff d1':>11} {'input d0':>9} {'input d1':>9}   (seconds, mean over runs)")
    for i in range(n):
        def mean(rs, key):
            return statistics.mean(x["stages"][i][key] for x in rs)
        s = first["stages"][i]
        print(f"{i:>5} {s['device']:<8} {str(s['layers'][0]) + '-' + str(s['layers'][1] - 1):<8} "
              f"{mean(rep0, 'work_s'):>9.3f} {mean(rep1, 'work_s'):>9.3f} {mean(rep0, 'handoff_wait_s'):>11.3f} "
              f"{mean(rep1, 'handoff_wait_s'):>11.3f} {mean(rep0, 'input_wait_s'):>9.3f} {mean(rep1, 'input_wait_s'):>9.3f}")
    print(f"tail (stage 0's last chunk end -> last stage's last chunk end), depth 1: "
          f"{statistics.mean(x['tail_s'] for x in rep1):.3f} s of {statistics.mean(x['seconds'] for x in rep1):.3f} s")
    md5s = {x["residual_md5"] for x in reports}
    print(f"residual md5 identical across all {len(reports)} runs: {len(md5s) == 1} ({sorted(md5s)[0]})")
    print(f"hand-off: {first['handoff_buffers']} buffer(s), {first['handoff_pinned_bytes']:,} bytes, "
          f"pinned={first['pinned']}, boundaries {'/'.join(first['boundaries'])}, hosts "
          f"{[s['host'] for s in first['stages']]}")
    if a.json:
        Path(a.json).write_text(json.dumps(reports, indent=1))
    print(f"date {time.strftime('%Y-%m-%d %H:%M')}, runs under {root}")
    return 0 if len(md5s) == 1 else 1


def in_namespaces(a) -> int:
    """This A/B again, run by the head inside namespace a, stage i > 0 in namespace i (ip netns exec)."""
    from strata.comm.netns import Netns, available
    why = available()
    if why:
        print(f"error: --netns: {why}", file=sys.stderr)
        return 2
    n = len(a.devices.split(",")) if a.devices else a.stages
    argv = [x for x in sys.argv[1:] if x != "--netns"]
    with Netns(n) as ns:
        argv += ["--hosts", ",".join(["local"] + ns.names[1:]), "--listen", ns.addr(0), "--remote-command",
                 "ip netns exec {host} {python} -m workers.join --join {join} --key {key}"]
        print(f"namespaces {ns.names} on one bridge ({ns.addr(0)} .. {ns.addr(n - 1)}): head and stage 0 in "
              f"{ns.names[0]}", flush=True)
        return subprocess.run(ns.exec(0) + [sys.executable, os.path.abspath(__file__), *argv]).returncode


if __name__ == "__main__":
    sys.exit(main())
