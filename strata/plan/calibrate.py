"""Device facts for the layer-split planner, measured before any stage starts.

* Speed: for each distinct (device, threads) of the rig, a short-lived spawned process builds ONE
  random decoder layer of the model's shape in the run's dtype (CPU: pinned to the cores the
  stage will get, with its torch threads) and times it on a real-size chunk at two contexts, the
  higher one mid-prompt (bounded on CPU, so a probe stays a second or two). From the two times
  it fits the layer's linear and attention throughputs (FLOP/s), so a bounded context still
  predicts the whole prompt. On the last stage's device it also times the final norm + head +
  cross-entropy on a chunk when the run computes perplexity: for a small model with a large
  vocabulary (SmolLM2: dim 576, vocab 49152) that head costs as much as ~8 layers.
* Free memory on a CUDA device: read in that process, after it has made its CUDA context, so the
  number is what a fresh stage process can allocate. The head itself never touches CUDA (a
  context there would hold ~0.5 GB of every card for the whole run).
* Host memory: MemAvailable, and the cgroup's limit when there is one.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from strata.models.args import ModelArgs
from strata.plan.planner import Speed
from strata.plan.schedule import chunk_flops

CPU_MAX_CONTEXT = 8192   # CPU probes time attention over at most this many cached positions
CPU_HEAD_ROWS = 256      # and the head on at most this many rows
TIMEOUT_S = 300.0


class CalibrationError(RuntimeError):
    pass


@dataclass
class Probe:
    device: str
    threads: int | None
    cores: tuple[int, ...] = ()
    free_bytes: int | None = None      # CUDA: free memory seen by a process holding a context
    total_bytes: int | None = None
    speed: Speed | None = None         # FLOP/s
    seconds: float = 0.0               # wall time of the probe process
    detail: dict = field(default_factory=dict)


def host_available_bytes() -> int | None:
    """Memory the host can still give: MemAvailable, capped by the cgroup's limit if any."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # cgroup v2
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            room = int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def stage_key(device: str, threads: int | None) -> tuple[str, int | None]:
    return (device, threads if device == "cpu" else None)


def probe(args: ModelArgs, dtype: str, jobs: list[dict], timeout_s: float = TIMEOUT_S) -> list[Probe]:
    """Run one spawned probe process per job; jobs: dict(device, threads, cores, speed, head, chunk,
    tokens). GPU probes run together; CPU probes together only when each is pinned to its own
    cores (otherwise one after another, so they do not disturb each other). Whatever happens,
    no probe process outlives this call."""
    ctx = mp.get_context("spawn")
    args_d = {f: getattr(args, f) for f in args.__dataclass_fields__}
    together = [k for k, j in enumerate(jobs) if j["device"] != "cpu" or j["cores"]]
    batches = [together] + [[k] for k, j in enumerate(jobs) if k not in together]
    results: dict[int, Probe] = {}
    for batch in batches:
        running = []
        try:
            for k in batch:
                rx, tx = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_probe_main, args=(args_d, dtype, jobs[k], tx), name=f"strata-probe-{k}",
                                daemon=True)
                p.start()
                tx.close()
                running.append((k, p, rx, time.perf_counter()))
            deadline = time.monotonic() + timeout_s
            for k, p, rx, t0 in running:
                job = jobs[k]
                where = job["device"] + (f" ({job['threads']} threads)" if job["device"] == "cpu" else "")
                try:
                    if not rx.poll(max(0.0, deadline - time.monotonic())):
                        raise CalibrationError(f"calibration on {where} gave no answer within {timeout_s:.0f}s")
                    status, res = rx.recv()
                except EOFError:
                    p.join(2.0)
                    raise CalibrationError(f"calibration on {where} died (exit code {p.exitcode})") from None
                if status != "ok":
                    raise CalibrationError(f"calibration on {where} failed: {res}")
                pr = Probe(job["device"], job["threads"], tuple(job["cores"]), res.get("free"), res.get("total"),
                           seconds=time.perf_counter() - t0, detail=res)
                if "linear" in res:
                    pr.speed = Speed(res["linear"], res["attention"], res.get("head") or res["linear"])
                results[k] = pr
        finally:
            for k, p, rx, _ in running:
                rx.close()
                p.join(5.0 if k in results else 0.0)
                if p.is_alive():
                    p.kill()
                    p.join(2.0)
    return [results[k] for k in range(len(jobs))]


# -- inside the probe process --------------------------------------------------------------------
def _probe_main(args_d: dict, dtype: str, job: dict, conn) -> None:
    try:
        import torch
        if job["device"] == "cpu":
            if job["threads"]:
                torch.set_num_threads(job["threads"])
            if job["cores"]:
                os.sched_setaffinity(0, job["cores"])
        else:
            torch.cuda.set_device(job["device"])
            torch.empty(1, device=job["device"])  # make the context now: free memory is then a stage's
        res: dict = {}
        if job["device"] != "cpu":
            res["free"], res["total"] = (int(x) for x in torch.cuda.mem_get_info(job["device"]))
        args = ModelArgs(**args_d)
        if job["speed"]:
            res.update(time_layer(args, job["device"], getattr(torch, dtype), job["chunk"], job["tokens"]))
        if job["head"]:
            res.update(time_head(args, job["device"], getattr(torch, dtype), job["chunk"]))
        conn.send(("ok", res))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the head, as one line
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except Exception:  # noqa: BLE001
            pass
    finally:
        conn.close()


def _timed(fn, sync, budget_s: float, max_reps: int) -> float:
    """Median seconds of fn() after a warm-up; repeats until budget_s or max_reps."""
    fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (not times or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def _sync_for(torch, device: str):
    return (lambda: torch.cuda.synchronize(device)) if device != "cpu" else (lambda: None)


def time_layer(args: ModelArgs, device: str, dtype, chunk: int, tokens: int) -> dict:
    """Time one random layer on a chunk of `chunk` rows at two contexts; fit linear and attention FLOP/s."""
    import torch
    from types import SimpleNamespace

    from strata.kernels.attention import rope_tables

    from strata.models.model import Block, Transformer, rope_frequencies

    cpu = device == "cpu"
    T = max(1, min(chunk, tokens))
    mid = max(0, tokens // 2 - T // 2)  # the mean context of the prompt's chunks
    hi = min(mid, CPU_MAX_CONTEXT) if cpu else mid
    lo = T if hi >= 2 * T else hi  # a short prompt: one context, one rate
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the run's dtype: no float32 copy of the layer first
    try:
        with torch.device(device):
            # a layer attending to every position (the costly kind, and the one a cache of hi + T rows serves)
            layer = next((i for i in range(args.n_layers) if args.window(i) is None and not args.is_linear(i)), 0)
            blk = Block(args, layer).eval()
            (kh, kw), (vh, vw) = args.kv_rows()
            blk.attn.k_cache = torch.randn(1, kh, hi + T, kw, dtype=dtype)
            blk.attn.v_cache = torch.randn(1, vh, hi + T, vw, dtype=dtype)
            blk.attn.max_len = hi + T
            h = torch.randn(1, T, args.dim, dtype=dtype)
    finally:
        torch.set_default_dtype(old)
    rope_src = SimpleNamespace(inv_freq=rope_frequencies(args).to(device))
    sync = _sync_for(torch, device)
    budget, reps = (0.3, 3) if cpu else (0.2, 20)

    def at(pos):
        cos, sin = rope_tables(*Transformer.rope(rope_src, pos, T, dtype))

        def run():
            with torch.inference_mode():
                blk(h, pos, cos, sin)
        return _timed(run, sync, budget, reps)

    t_hi = at(hi)
    lin_hi, att_hi = chunk_flops(args, hi, T)
    out = {"chunk": T, "context": hi, "layer_s": t_hi, "context_mid": mid}
    single = (lin_hi + att_hi) / t_hi
    lin_s = att_s = single
    if lo != hi:
        t_lo = at(lo)
        lin_lo, att_lo = chunk_flops(args, lo, T)
        out.update(context_lo=lo, layer_lo_s=t_lo)
        # t = lin/Sl + att/Sa at both contexts: two equations, two unknowns
        dt = t_hi - t_lo
        if dt > 0.05 * t_hi:
            inv_a = dt / (att_hi - att_lo)
            rest = t_lo - att_lo * inv_a
            if rest > 0.1 * t_lo:
                lin_s, att_s = lin_lo / rest, 1.0 / inv_a
    out.update(linear=lin_s, attention=att_s, single=single)
    return out


def time_head(args: ModelArgs, device: str, dtype, chunk: int) -> dict:
    """Time the last stage's perplexity work on a chunk: final norm + head + cross-entropy (Transformer.nll)."""
    import torch
    from torch import nn

    from strata.models.model import RMSNorm, Transformer

    class _Head(nn.Module):
        logits = Transformer.logits
        nll = Transformer.nll
        _head_weight_only = _blocks = None  # what Transformer.logits asks: no decode-only head here

        def __init__(self):
            super().__init__()
            self.args = args  # (Transformer.logits reads its final softcap)
            self.norm = RMSNorm(args.dim, args.norm_eps)
            self.head = nn.Linear(args.dim, args.vocab_size, bias=False)

    cpu = device == "cpu"
    T = max(1, min(chunk, CPU_HEAD_ROWS) if cpu else chunk)
    torch.manual_seed(1)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            m = _Head().eval()
            h = torch.randn(1, T, args.dim, dtype=dtype)
            targets = torch.randint(0, args.vocab_size, (T,))
    finally:
        torch.set_default_dtype(old)
    sync = _sync_for(torch, device)
    t = _timed(lambda: m.nll(h, targets), sync, 0.3 if cpu else 0.2, 3 if cpu else 20)
    return {"head": 2.0 * args.vocab_size * args.dim * T / t, "head_rows": T, "head_s": t}


# -- what build_plan asks -------------------------------------------------------------------------
@dataclass
class StageFacts:
    caps: list[int | None]
    cap_notes: list[str]
    speeds: list[Speed | float]
    source: str                       # "rig" | "calibrated" | "equal"
    probes: list[Probe] = field(default_factory=list)
    seconds: float = 0.0


def stage_facts(stages, cores: list[tuple[int, ...]], args: ModelArgs, dtype: str, chunk: int, kv_tokens: int,
                prompt_tokens: int, want_speed: bool, with_head: bool,
                always_calibrate: bool = False) -> StageFacts:
    """Caps and speeds for the planner. Probes run only for what the rig leaves open: free memory
    of a CUDA stage without `memory:`; speeds when `want_speed` (layer_split auto), there is more
    than one stage, no stage gives `speed:`, and the stages differ, a probe runs anyway or `always_calibrate`
    (identical stages timed too: bench/split.py --calibrate)."""
    from strata.plan.planner import CUDA_CONTEXT_BYTES
    n = len(stages)
    keys = [stage_key(s.device, s.threads) for s in stages]
    caps: list[int | None] = [None] * n
    notes = [""] * n
    for i, s in enumerate(stages):
        if s.memory is not None:
            if s.device == "cpu":
                caps[i], notes[i] = s.memory, "stages[].memory"
            else:
                caps[i] = max(0, s.memory - CUDA_CONTEXT_BYTES)
                notes[i] = f"stages[].memory {_gb(s.memory)} less {_gb(CUDA_CONTEXT_BYTES)} for the CUDA context"
    given = [s.speed for s in stages]
    need_mem = {k for i, k in enumerate(keys) if k[0] != "cpu" and stages[i].memory is None}
    if not want_speed or n == 1:
        speeds, source, calibrate = [g or 1.0 for g in given], ("rig" if all(given) else "equal"), False
    elif all(g is not None for g in given):
        speeds, source, calibrate = list(given), "rig", False
    elif len(set(keys)) == 1 and not need_mem and not always_calibrate:
        # identical stages and no probe to run anyway: equal speeds by construction (the head's
        # share is then costed in FLOPs); keeps runs of identical CPU stages free of probes
        speeds, source, calibrate = [1.0] * n, "equal", False
    else:
        speeds, source, calibrate = [1.0] * n, "calibrated", True
    jobs, job_of = [], {}
    for i, k in enumerate(keys):
        if k in job_of or not (calibrate or k in need_mem):
            continue
        job_of[k] = len(jobs)
        jobs.append(dict(device=k[0], threads=k[1], cores=list(cores[i]), speed=calibrate,
                         head=False, chunk=chunk, tokens=prompt_tokens))
    if calibrate and with_head:
        jobs[job_of[keys[-1]]]["head"] = True
    t0 = time.perf_counter()
    probes = probe(args, dtype, jobs) if jobs else []
    seconds = time.perf_counter() - t0 if jobs else 0.0
    for i, k in enumerate(keys):
        if k in need_mem:
            pr = probes[job_of[k]]
            on_dev = [j for j, kk in enumerate(keys) if kk == k]
            sharing = sum(1 for j in on_dev if stages[j].memory is None)
            # several stages on one card: the others' contexts and rig caps come off first
            free = (pr.free_bytes - (len(on_dev) - 1) * CUDA_CONTEXT_BYTES
                    - sum(stages[j].memory or 0 for j in on_dev))
            caps[i] = max(0, free // sharing)
            notes[i] = f"free on {k[0]} now" + (f", shared by {sharing} stages" if sharing > 1 else "")
        if calibrate:
            speeds[i] = probes[job_of[k]].speed
    return StageFacts(caps, notes, speeds, source, probes, seconds)


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


__all__ = ["CalibrationError", "Probe", "StageFacts", "host_available_bytes", "probe", "stage_facts",
           "time_head", "time_layer"]
