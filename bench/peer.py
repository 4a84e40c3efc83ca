"""Strata beside llama.cpp on the same GGUF file and GPUs, in one process run: the peer table.

Arms (any subset, in this order): `llama` (llama-bench, `-sm layer` on several GPUs), `d1` / `d0` (Strata on
the same file, depth 1 / depth 0, resident quantized weights unless `--weights`), `bf16` / `bf16d0` (Strata,
the same shape with bf16 synthetic weights, depth 1 / 0), `hf` (transformers `LlamaForCausalLM`, placed by
accelerate `device_map="auto"` over the same GPUs: bench/accelerate_baseline.py, same synthetic weights).
A random-block GGUF of the preset shape is written first if `--gguf` does not exist
(bench/make_gguf.py), so both arms time the same file.

    python bench/peer.py --preset llama-3-70b --qtype IQ3_S --devices cuda:0,cuda:1 \
        --tokens 122880 --chunk 10240 --gguf /tmp/70b-iq3s.gguf --llama-bench /tmp/ll/build/bin/llama-bench

Prints one table with tok/s, ratios against llama.cpp and against Strata bf16, depth1/depth0, and
whether the residual md5 is identical across the depth arms.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def llama_bench(exe: str, gguf: Path, tokens: int, chunk: int, n_devices: int, decode: int,
                warmup: bool = True) -> dict:
    """llama-bench's prefill (and, with decode > 0, generation) tok/s on the file, every layer on GPU."""
    out = {}
    runs = [("prefill", ["-p", str(tokens), "-n", "0"])]
    if decode:
        runs.append(("decode", ["-p", "0", "-n", str(decode)]))
    for what, extra in runs:
        cmd = [exe, "-m", str(gguf), "-ngl", "99", "-fa", "1", "-b", str(chunk), "-ub", "2048", "-r", "1",
               "-o", "json", *extra] + ([] if warmup else ["--no-warmup"])
        if n_devices > 1:
            cmd += ["-sm", "layer"]
        t = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"llama-bench failed ({p.returncode}): {p.stderr[-2000:]}")
        rows = json.loads(p.stdout)
        out[what] = rows[0]["avg_ts"]
        out[what + "_wall_s"] = time.perf_counter() - t
        print(f"llama.cpp {what}: {out[what]:,.1f} tok/s ({' '.join(cmd[1:])})", flush=True)
    return out


def strata_run(model: str, devices: list[str], tokens: int, chunk: int, depth: int, weights: str, out: Path,
               decode: int, dynamic: bool = False, dump: bool = True) -> dict:
    from strata.head.pipeline import Pipeline
    cfg = dict(model=model, dtype="bfloat16", stages=[{"device": d} for d in devices], chunk=chunk, depth=depth,
               dynamic_chunks=dynamic,
               prompt={"random": {"tokens": tokens, "seed": 0}}, dump_residual=dump, timing=True,
               progress=False, perplexity=False, generate=decode)
    if weights:
        cfg["weights"] = weights
    t = time.perf_counter()
    with Pipeline(cfg, out=out, console=False) as p:
        p.start()
        load_s = time.perf_counter() - t
        rep = p.prefill().report
    rep["load_wall_s"] = load_s
    for f in sorted(out.glob("stage-*.log")):  # what each stage's warm-up built: a shape left out builds in the timing
        for line in f.read_text(errors="replace").splitlines():
            if any(w in line for w in ("warmed for", "FlexAttention compiled", "warm-up:")):
                print(f"  {f.name}: {line.strip()[-200:]}", flush=True)
    if rep.get("residual_file"):
        Path(rep["residual_file"]).unlink()  # md5 kept; the dump is tokens x dim float32
    print(f"strata {model} depth {depth}: {rep['tok_s']:,.1f} tok/s ({rep['seconds']:.2f} s; load {load_s:.1f} s; "
          f"md5 {str(rep.get('residual_md5'))[:12]}; weights {[s.get('weight_bytes') for s in rep['stages']]})",
          flush=True)
    return rep


def stage_facts(rep: dict) -> list[dict]:
    """Each stage's place, work and memory from a report (state_bytes: linear-attention layers' states; peak_bytes:
    a CUDA stage's torch.cuda.max_memory_allocated over the prefill)."""
    keys = ("device", "layers", "work_s", "weight_bytes", "kv_bytes", "state_bytes", "scratch_bytes", "mem_bytes",
            "peak_bytes")
    return [{k: s.get(k) for k in keys} for s in rep["stages"]]


def hf_run(preset: str, devices: list[str], tokens: int, chunk: int) -> dict:
    """bench/accelerate_baseline.py in a process of its own, seeing only these GPUs."""
    import os
    import re
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(d.split(":")[1] for d in devices))
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "accelerate_baseline.py"), "--preset", preset,
                        "--tokens", str(tokens), "--chunk", str(chunk)], capture_output=True, text=True, env=env)
    m = re.search(r"([\d.]+) s, ([\d,]+) tok/s", p.stdout)
    if p.returncode or not m:
        print(f"transformers failed ({p.returncode}): {(p.stdout + p.stderr)[-1500:]}", flush=True)
        return {}
    print(p.stdout.strip().splitlines()[-1], flush=True)
    return {"tok_s": float(m.group(2).replace(",", "")), "seconds": float(m.group(1))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3-70b")
    ap.add_argument("--qtype", default="IQ3_S")
    ap.add_argument("--devices", default="cuda:0,cuda:1")
    ap.add_argument("--tokens", type=int, default=122880)
    ap.add_argument("--chunk", type=int, default=10240, help="tokens per chunk (the largest, with --dynamic)")
    ap.add_argument("--dynamic", action="store_true", help="Strata arms: rig `dynamic_chunks: true` (later chunks "
                    "shrink so each costs what the first does: the pipeline's tail is one small chunk)")
    ap.add_argument("--gguf", help="the random-block GGUF (written if missing)")
    ap.add_argument("--llama-bench", help="llama-bench executable (the llama arm is skipped without it)")
    ap.add_argument("--arms", default="llama,d1,d0,bf16")
    ap.add_argument("--no-dump", action="store_true", help="Strata arms without the residual dump (the rig's "
                    "default): no md5 to compare")
    ap.add_argument("--weights", default="", help="rig `weights` for the Strata arms on the file (default: auto)")
    ap.add_argument("--decode", type=int, default=0, help="also time this many generated tokens")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--llama-no-warmup", action="store_true", help="llama-bench --no-warmup: its warm-up pass is a "
                    "whole prompt run, which doubles a long 70B prefill's time")
    a = ap.parse_args()
    devices = a.devices.split(",")
    arms = a.arms.split(",")
    gguf = Path(a.gguf or Path(tempfile.gettempdir()) / f"{a.preset}-{a.qtype}.gguf")
    if any(x in arms for x in ("llama", "d1", "d0")) and not gguf.exists():
        t = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "bench" / "make_gguf.py"), "--preset", a.preset, "--qtype", a.qtype,
                        "--out", str(gguf), "--seed", "0",
                        "--device", devices[0].split(":")[0]], check=True)
        print(f"wrote {gguf} ({gguf.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t:.1f} s", flush=True)
    root = Path(tempfile.mkdtemp(prefix="strata-peer-"))
    res: dict = {"preset": a.preset, "qtype": a.qtype, "devices": devices, "tokens": a.tokens, "chunk": a.chunk,
                 "dynamic_chunks": a.dynamic,
                 "date": time.strftime("%Y-%m-%d %H:%M")}
    if "llama" in arms and a.llama_bench:
        res["llama"] = llama_bench(a.llama_bench, gguf, a.tokens, a.chunk, len(devices), a.decode,
                                   warmup=not a.llama_no_warmup)
    for arm in ("d1", "d0"):
        if arm in arms:
            rep = strata_run(str(gguf), devices, a.tokens, a.chunk, int(arm[1]), a.weights, root / arm, a.decode,
                             a.dynamic, not a.no_dump)
            res[arm] = {k: rep.get(k) for k in ("tok_s", "seconds", "residual_md5", "load_wall_s", "decode_tok_s",
                                                "max_context")}
            res[arm]["stages"] = stage_facts(rep)
    for arm, depth in (("bf16", 1), ("bf16d0", 0)):
        if arm in arms:
            rep = strata_run(f"synthetic:{a.preset}", devices, a.tokens, a.chunk, depth, "", root / arm, a.decode,
                             a.dynamic, not a.no_dump)
            res[arm] = {k: rep.get(k) for k in ("tok_s", "seconds", "load_wall_s", "decode_tok_s", "residual_md5")}
            res[arm]["stages"] = stage_facts(rep)
            res[arm]["warm_s"] = [s.get("warm_s") for s in rep["stages"]]
            res[arm]["chunk_s"] = [[round(e[2] - e[1], 3) for e in ev] for ev in rep.get("events", [])]
            res[arm]["events"] = rep.get("events", [])  # [k, work start, work end, hand-off] per stage
    if "hf" in arms:
        res["hf"] = hf_run(a.preset, devices, a.tokens, a.chunk)

    print()
    print(f"{a.preset} {a.qtype} ({gguf.name}), {len(devices)} x {devices[0]}, {a.tokens:,} tokens, chunk {a.chunk:,}"
          + (" (Strata: dynamic chunks)" if a.dynamic else ""))
    llama = res.get("llama", {}).get("prefill")
    bf16 = res.get("bf16", {}).get("tok_s")
    print("| arm | prefill tok/s | vs llama.cpp | vs Strata bf16 |")
    print("|---|---:|---:|---:|")
    rows = [("llama.cpp" + (" `-sm layer`" if len(devices) > 1 else ""), llama),
            ("Strata depth 1, quantized resident", res.get("d1", {}).get("tok_s")),
            ("Strata depth 0, quantized resident", res.get("d0", {}).get("tok_s")), ("Strata depth 1, bf16", bf16),
            ("Strata depth 0, bf16", res.get("bf16d0", {}).get("tok_s")),
            ("transformers" + (" + accelerate `device_map=auto`" if len(devices) > 1 else "") + ", bf16",
             res.get("hf", {}).get("tok_s"))]
    for name, v in rows:
        if v:
            print(f"| {name} | {v:,.1f} | {v / llama:.2f}x |" if llama else f"| {name} | {v:,.1f} | - |", end="")
            print(f" {v / bf16:.0%} |" if bf16 else " - |")
    if "d1" in res and "d0" in res:
        print(f"depth1/depth0: {res['d1']['tok_s'] / res['d0']['tok_s']:.2f}x; residual md5 identical: "
              f"{res['d1']['residual_md5'] == res['d0']['residual_md5']} ({res['d1']['residual_md5']})")
    if "bf16" in res and "bf16d0" in res:
        print(f"bf16 depth1/depth0: {res['bf16']['tok_s'] / res['bf16d0']['tok_s']:.2f}x; residual md5 identical: "
              f"{res['bf16']['residual_md5'] == res['bf16d0']['residual_md5']}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
