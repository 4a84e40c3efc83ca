"""What a run reports: report.json fields, the console table, the busy histogram, timeline.png."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

STARTUP_PARTS = ("imports_s", "plan_s", "tokenizer_s", "spawn_s", "ready_wait_s", "other_s")


def process_start() -> float:
    """This process's start on the perf_counter clock (from /proc: ~10 ms resolution); now if unknown."""
    now = time.perf_counter()
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime (clock ticks after boot)
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
        return now - max(0.0, up - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return now


def startup_breakdown(marks: dict[str, float], tokenizer_s: float, stage_load_s: float) -> dict:
    """From perf_counter marks on the head's path (process, imports, planned, spawn, spawned, ready, first)
    to the seconds of each consecutive part; `other_s` is what lies between them (the head between
    its plan and `start`, the ids copy, the first send), so the parts sum to `total_s`. stage_load_s (the
    slowest stage's own load) is inside spawn + ready wait, not a part of its own."""
    m = marks
    out = {"imports_s": m["imports"] - m["process"], "plan_s": m["planned"] - m["imports"] - tokenizer_s,
           "tokenizer_s": tokenizer_s, "spawn_s": m["spawned"] - m["spawn"], "ready_wait_s": m["ready"] - m["spawned"]}
    total = m["first"] - m["process"]
    out["other_s"] = total - sum(out.values())
    out.update(total_s=total, stage_load_s=stage_load_s)
    return out


def format_startup(s: dict) -> str:
    return (f"startup: {s['total_s']:.2f}s to the first chunk (imports {s['imports_s']:.2f}, plan {s['plan_s']:.2f}, "
            f"tokenizer {s['tokenizer_s']:.2f}, spawn {s['spawn_s']:.2f}, ready wait {s['ready_wait_s']:.2f} "
            f"[slowest stage load {s['stage_load_s']:.2f}], other {s['other_s']:.2f}; stages by {s.get('stage_start', '?')})")


def busy_histogram(intervals: list[list[tuple[float, float]]], t0: float, t1: float) -> dict:
    """Fraction of [t0, t1] with exactly one, exactly two, three or more stages working.

    Exact: a sweep over the stages' work intervals, not samples."""
    edges = []
    for per_stage in intervals:
        for a, b in per_stage:
            a, b = max(a, t0), min(b, t1)
            if b > a:
                edges += [(a, 1), (b, -1)]
    edges.sort()
    span = max(t1 - t0, 1e-12)
    acc = {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}
    busy, last = 0, t0
    for t, d in edges:
        acc[min(busy, 3)] += t - last
        busy, last = busy + d, t
    acc[min(busy, 3)] += t1 - last
    return {"none": acc[0] / span, "one": acc[1] / span, "two": acc[2] / span, "three_plus": acc[3] / span}


def md5_file(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_report(p, seconds: float, ppl, cont, text, ids=None, schedule=None, reused: int = 0,
                 perplexity_tokens: int | None = None, decode: dict | None = None) -> dict:
    """The report of one prefill (and its continuation): written to DIR/report.json, printed by the launcher.

    ids / schedule: the prompt and the chunks computed (default: the rig's); reused: leading prompt positions
    whose KV the stages already held (not computed, not in the perplexity); decode: the decode figures."""
    plan, cfg = p.plan, p.cfg
    tokens = plan.tokens if ids is None else int(len(ids))
    schedule = plan.schedule if schedule is None else schedule
    computed = tokens - reused
    stages, intervals, events = [], [], []
    for st in p.stages:
        s = st.stats["prefill"]  # the stage's Stats message
        ev = s.events
        intervals.append([(e[1], e[2]) for e in ev])
        stages.append({"index": st.index, "device": st.device, "host": st.host or "local",
                       "layers": list(st.layers), "pid": st.pid,
                       "wall_s": s.wall_s, "work_s": s.work_s, "handoff_wait_s": s.handoff_wait_s,
                       "input_wait_s": s.input_wait_s, "copy_s": s.copy_s, "chunks": s.chunks, "mem_bytes": st.mem_bytes,
                       "kv_bytes": st.kv_bytes, "state_bytes": st.state_bytes, "weights": st.weights,
                       "weight_bytes": st.weight_bytes,
                       "scratch_bytes": st.scratch_bytes, "pinned": st.pinned, "load_s": st.load_s,
                       "warm_s": st.warm_s, "peak_bytes": s.peak_bytes,
                       "bad_frames": s.bad_frames})
        events.append([[e[0], e[1], e[2], e[3]] for e in ev])
    planner = getattr(plan, "planner", None) or {}  # absent on plans made without the planner
    for i, st in enumerate(stages):  # the planner's prediction beside the measured work
        if planner.get("predicted"):
            st["predicted_s"] = planner["predicted"][i] if planner["unit"] == "s" else None
            st["predicted_share"] = planner["predicted_share"][i]
            st["need_bytes"] = planner["needs"][i]["total"]
            st["cap_bytes"] = planner["caps"][i]
    work = sum(st["work_s"] for st in stages) or 1.0
    for st in stages:
        st["work_share"] = st["work_s"] / work
    all_ev = [e for ev in events for e in ev]
    begin = min((e[1] for e in all_ev), default=0.0)
    end = max((e[3] for e in all_ev), default=0.0)
    # events relative to the first work start, so the timeline reads in seconds from zero
    rel = [[[k, a - begin, b - begin, c - begin] for k, a, b, c in ev] for ev in events]
    n_boundaries = len(plan.stages) - 1
    report = {
        # tok_s: prompt positions computed (a reused prefix is not) per second of prefill
        "tokens": tokens, "reused_tokens": reused, "prefilled_tokens": computed, "max_context": plan.max_len,
        "seconds": seconds, "tok_s": computed / seconds if seconds else 0.0,
        "timing": cfg.timing,  # the console shows the timing table and busy histogram only when set
        "depth": cfg.depth, "chunk": plan.max_chunk, "chunks": len(schedule),
        "dynamic_chunks": cfg.dynamic_chunks, "schedule": [list(x) for x in schedule],
        "model": cfg.model, "dtype": cfg.dtype, "stages": stages,
        "split": [s.end - s.start for s in plan.stages], "planner": planner,
        "busy": busy_histogram(intervals, begin, end),
        "handoff_pinned_bytes": n_boundaries * plan.handoff_bytes(),
        "handoff_buffers": n_boundaries,
        # per boundary: "shm" (both stages on this host) or "tcp" (across hosts, CurveZMQ)
        "boundaries": list(getattr(p, "boundaries", [])) or ["shm"] * n_boundaries,
        "rejected_connections": getattr(p, "rejected_connections", 0),
        "pinned": all(s["pinned"] for s in stages if s["device"].startswith("cuda")) and
        any(s["device"].startswith("cuda") for s in stages),
        "head_bad_frames": getattr(p, "bad_frames", 0),  # frames the head rejected during the run
        # perplexity over the prompt positions computed this time: perplexity_tokens targets (a reused prefix's
        # positions are not among them)
        "perplexity": ppl, "perplexity_tokens": perplexity_tokens or 0,
        "continuation_ids": cont, "continuation": text,
        "decode_tokens": 0, "decode_steps": 0, "decode_s": 0.0, "decode_tok_s": 0.0, "ttft_s": None,
        "finish_reason": None, "decode_weights": cfg.decode_weights, "cuda_graphs": cfg.cuda_graphs,
        # the tail: after stage 0 finishes its last chunk, the time until the last stage finishes it
        "tail_s": (events[-1][-1][2] - events[0][-1][2]) if events[0] and events[-1] else 0.0,
        "events": rel, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    startup = getattr(p, "startup", None)  # measured once per Pipeline, at its first chunk
    if startup:
        report["startup_s"] = startup["total_s"]
        report["startup"] = startup
    if decode:
        report.update(decode)
        dec = [st.stats.get("decode") for st in p.stages]
        if decode.get("decode_steps") and all(dec):
            # one stage works at a time in decode: what the stages' sums do not cover is messaging and the head
            work = sum(d.work_s for d in dec)
            for st, d in zip(stages, dec):
                st["decode_work_s"], st["decode_copy_s"] = d.work_s, d.copy_s
            report["decode_work_s"] = work
            report["decode_overhead_ms_per_token"] = 1000 * max(0.0, decode["decode_s"] - work) / decode["decode_steps"]
    if cfg.dump_residual:
        path = p.out / "residual.npy"
        report["residual_file"] = str(path)
        report["residual_md5"] = md5_file(path)
    (p.out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def format_table(report: dict) -> str:
    """The console summary. The per-stage timing table and the busy histogram only with `timing`
    (report.json has those figures either way)."""
    timing = report.get("timing", True)
    rows = []
    if timing:
        rows.append(f"{'stage':>5} {'device':<8} {'layers':<9} {'wall s':>8} {'work s':>8} {'handoff s':>9} "
                    f"{'input s':>8}")
        for s in report["stages"]:
            a, b = s["layers"]
            rows.append(f"{s['index']:>5} {s['device']:<8} {f'{a}-{b - 1}':<9} {s['wall_s']:>8.3f} "
                        f"{s['work_s']:>8.3f} {s['handoff_wait_s']:>9.3f} {s['input_wait_s']:>8.3f}")
    pl = report.get("planner") or {}
    if pl.get("predicted"):
        st = report["stages"]
        if pl["unit"] == "s":
            pred = " / ".join(f"{s['predicted_s']:.2f}" for s in st) + " s"
        else:
            pred = " / ".join(f"{s['predicted_share']:.0%}" for s in st)
        rows.append(f"split {report['split']} ({pl['mode']}, speeds {pl['speeds_from']}): predicted {pred}; "
                    f"measured work " + " / ".join(f"{s['work_s']:.2f}" for s in st) + " s ("
                    + " / ".join(f"{s['work_share']:.0%}" for s in st) + ")")
    busy = report["busy"]
    if timing:
        rows.append(f"busy: one {busy['one']:.0%}  two {busy['two']:.0%}  three+ {busy['three_plus']:.0%}  "
                    f"(none {busy['none']:.0%})")
    rows.append(f"{report['tokens']:,} tokens in {report['seconds']:.2f}s = {report['tok_s']:,.1f} tok/s "
                f"(depth {report['depth']}, {report['chunks']} chunks of <= {report['chunk']})")
    rows.append(f"hand-off: {report['handoff_buffers']} buffer(s), {report['handoff_pinned_bytes']:,} bytes"
                f"{' pinned' if report['pinned'] else ' (shared memory, CPU stages)'}")
    if "tcp" in report.get("boundaries", ()):
        rows.append(f"across hosts: boundaries {' / '.join(report['boundaries'])} (tcp: CurveZMQ frames); "
                    f"{report['rejected_connections']} connection(s) without the run's key refused")
    if report.get("reused_tokens"):
        rows.append(f"prefix reuse: {report['reused_tokens']:,} of {report['tokens']:,} prompt tokens were already "
                    f"in the stages' KV; {report['prefilled_tokens']:,} prefilled")
    if report.get("decode_steps"):
        over = report.get("decode_overhead_ms_per_token")
        rows.append(f"decode: {report['decode_tokens']} tokens, {report['decode_steps']} steps in "
                    f"{report['decode_s']:.2f}s = {report['decode_tok_s']:,.1f} tok/s"
                    + (f" ({over:.2f} ms/token outside the stages' work)" if over is not None else "")
                    + (f"; first token after {report['ttft_s']:.3f}s" if report.get("ttft_s") else ""))
    if report.get("startup"):
        rows.append(format_startup(report["startup"]))
    if report.get("residual_md5"):
        rows.append(f"residual md5 {report['residual_md5']}")
    if report.get("perplexity") is not None:
        part = f" (the {report['perplexity_tokens']:,} positions computed)" if report.get("reused_tokens") else ""
        rows.append(f"prompt perplexity {report['perplexity']:.4f}{part}")
    if report.get("continuation") is not None:
        rows.append(f"continuation: {report['continuation']!r}")
    elif report.get("continuation_ids"):
        rows.append(f"continuation ids: {report['continuation_ids']}")
    return "\n".join(rows)


def draw_timeline(report: dict, path: Path) -> None:
    """One row per stage, one bar per chunk of work; gaps are waits. Headless."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = report["events"]
    n = len(ev)
    fig, ax = plt.subplots(figsize=(12, 0.8 + 0.6 * n))
    colors = plt.get_cmap("tab20")
    for i, stage_ev in enumerate(ev):
        for k, a, b, c in stage_ev:
            ax.broken_barh([(a, b - a)], (i - 0.35, 0.7), color=colors(k % 20))
            if c > b:  # waiting to hand off (reap / join)
                ax.broken_barh([(b, c - b)], (i - 0.1, 0.2), color="0.75")
            if b - a > 0.04 * max(1e-9, report["seconds"]):
                ax.text((a + b) / 2, i, str(k), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"stage {s['index']}\n{s['device']}" for s in report["stages"]])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    b = report["busy"]
    ax.set_title(f"depth {report['depth']}: {report['tok_s']:,.0f} tok/s; busy one {b['one']:.0%}, "
                 f"two {b['two']:.0%}, three+ {b['three_plus']:.0%}  (bars: work per chunk; grey: hand-off wait)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
