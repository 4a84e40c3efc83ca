#!/usr/bin/env bash
# DeepSeek V3's shapes on one H100 beside llama.cpp (issue 56 item 8): an 8-layer slice (3 dense + 5 MoE layers of
# V3's real widths: preset deepseek-v3-slice) as a random-block Q4_K_M deepseek2 GGUF (~37 GiB), the same file
# timed by llama-bench and by Strata. Steps (each runnable alone; a warm machine keeps /tmp between calls):
#   setup   the carried wheels (.whl: pyzmq, gguf) into /tmp/site, the GPU and the disk    (every call: PYTHONPATH
#           is per call)
#   build   llama.cpp (llama-bench, CUDA sm_90) from the carried .peer/llama.tgz into $LL, in the background at
#           nice 19 (~330 s); a call that started it waits for it before it ends
#   gguf    bench/make_gguf.py --preset $PRESET --qtype $QTYPE --device cuda -> $GGUF
#   llama   llama-bench -ngl 99 -fa 1 -b $CHUNK -ub 2048 -r 1: prefill of each of $LENGTHS (-p L -n 0; its warm-up
#           is a whole prompt run, so past 32,768 tokens --no-warmup), decode of $DECODE_TOKENS tokens after each of
#           $DEPTHS (-p 0 -n 128 -d D); the longest prefill last -> $OUT/llama-*.json
#   strata  Strata on the same file, one stage on $DEVICE: bench/peer.py's cold launch-and-prefill of each of $LENGTHS
#           (random ids, chunk $CHUNK; report.json's tok/s, kv_bytes and each stage's peak torch.cuda
#           max_memory_allocated), bench/generate.py's decode after each of $DEPTHS; the longest prefill last
#           -> $OUT/strata-*.json
#   table   Strata beside llama.cpp with ratios, KV bytes per token and the peak memory, from those JSON files
#   llama-short llama-decode llama-long strata-short strata-decode strata-long: a part of llama / strata alone (the
#           prefills up to 32,768 tokens, the decode, the longer prefills), e.g. for one a deadline skipped
# Run from the repo root on the GPU machine, carrying .whl and .peer/llama.tgz, in three calls (each < 600 s):
#   bash bench/device_deepseek.sh setup build gguf     # ~400 s: the build, the 37 GiB file written meanwhile
#   bash bench/device_deepseek.sh setup llama          # llama.cpp's rows
#   bash bench/device_deepseek.sh setup strata table   # Strata's rows and the table
# DEADLINE (seconds since the start, default 570) skips a step whose usual time would pass it, by name. PRESET,
# QTYPE, GGUF, LENGTHS, DEPTHS, CHUNK, DECODE_TOKENS, DEVICE (cuda, or cpu: the CPU test's smoke-deepseek run) and PY
# (python3) may be set, e.g. QTYPE=IQ3_S GGUF=/tmp/dsv3-slice-iq3s.gguf (~25 GiB: attn_k_b IQ4_NL, as llama.cpp's
# quantizer falls back). Logs and JSON go to $OUT (the device's returned folder) or /tmp/ds-logs.
PRESET=${PRESET:-deepseek-v3-slice}; QTYPE=${QTYPE:-Q4_K_M}; GGUF=${GGUF:-/tmp/dsv3-slice-q4km.gguf}
LENGTHS=${LENGTHS:-32768,131072}; DEPTHS=${DEPTHS:-2048,32768}; CHUNK=${CHUNK:-10240}
DECODE_TOKENS=${DECODE_TOKENS:-128}
DEVICE=${DEVICE:-cuda}; PY=${PY:-python3}
SDEV=$DEVICE; [ "$DEVICE" = cuda ] && SDEV=cuda:0
LOG=${OUT:-/tmp/ds-logs}; mkdir -p "$LOG"
. "$(dirname "$0")/device_common.sh"  # el, left, fits, wheels, build, build_wait
SHORT=32768  # prefills up to this length run first (llama.cpp with its warm-up), the longer ones after the decode

setup() {
  wheels zmq gguf
  el "setup: $($PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
    torch.cuda.get_device_name(0))')"
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  df -h /tmp | tail -1; free -g | head -2
}

need_gguf() { [ -s "$GGUF" ] && return 0; el "$1: no $GGUF (run the gguf step first)"; return 1; }
lengths() {  # short | long: $LENGTHS up to SHORT, or past it
  local l; for l in ${LENGTHS//,/ }; do
    if [ "$1" = short ] && [ "$l" -le $SHORT ]; then echo "$l"
    elif [ "$1" = long ] && [ "$l" -gt $SHORT ]; then echo "$l"; fi
  done
}

gguf() {
  if [ -s "$GGUF" ]; then el "gguf: $GGUF exists ($(du -h "$GGUF" | cut -f1))"; return; fi
  fits "gguf $PRESET" 200 || return
  $PY bench/make_gguf.py --preset "$PRESET" --qtype "$QTYPE" --out /dev/null --size
  el "gguf: $PRESET $QTYPE -> $GGUF (bench/make_gguf.py --device $DEVICE)"
  timeout $(( $(left) + 20 )) $PY bench/make_gguf.py --preset "$PRESET" --qtype "$QTYPE" --out "$GGUF.part" \
    --device "$DEVICE" 2>&1 | tail -1 && mv "$GGUF.part" "$GGUF"
  rm -f "$GGUF.part"; df -h "$(dirname "$GGUF")" | tail -1
}

llama_prefill() {  # TOKENS EST_S
  fits "llama.cpp prefill $1" "$2" || return
  local warm=(); [ "$1" -gt $SHORT ] && warm=(--no-warmup)
  el "llama.cpp: prefill $1 tokens"
  timeout $(( $(left) + 20 )) "$LB" -m "$GGUF" -ngl 99 -fa 1 -b "$CHUNK" -ub 2048 -r 1 -p "$1" -n 0 "${warm[@]}" \
    -o json \
    > "$LOG/llama-prefill-$1.json" 2> "$LOG/llama-prefill-$1.err"
  echo "rc $?: $(grep -o '"avg_ts": [0-9.]*' "$LOG/llama-prefill-$1.json")"; tail -2 "$LOG/llama-prefill-$1.err"
}

llama_ready() { need_gguf "$1" && build_wait; }
llama_short() { local l; llama_ready llama-short || return; for l in $(lengths short); do llama_prefill "$l" 90; done; }
llama_long() { local l; llama_ready llama-long || return; for l in $(lengths long); do llama_prefill "$l" 240; done; }
llama_decode() {
  llama_ready llama-decode || return
  fits "llama.cpp decode" 120 || return
  el "llama.cpp: decode $DECODE_TOKENS tokens after $DEPTHS"
  timeout $(( $(left) + 20 )) "$LB" -m "$GGUF" -ngl 99 -fa 1 -b "$CHUNK" -ub 2048 -r 1 -p 0 -n "$DECODE_TOKENS" \
    -d "$DEPTHS" -o json > "$LOG/llama-decode.json" 2> "$LOG/llama-decode.err"
  echo "rc $?: $(grep -o '"avg_ts": [0-9.]*' "$LOG/llama-decode.json" | tr '\n' ' ')"; tail -2 "$LOG/llama-decode.err"
}
llama() { need_gguf llama || return; llama_short; llama_decode; llama_long; }

strata_prefill() {  # TOKENS EST_S
  fits "strata prefill $1" "$2" || return
  el "strata: prefill $1 tokens (bench/peer.py, cold: load, warm-up, one prompt)"
  timeout $(( $(left) + 20 )) $PY bench/peer.py --preset "$PRESET" --qtype "$QTYPE" --devices "$SDEV" --tokens "$1" \
    --chunk "$CHUNK" --gguf "$GGUF" --arms d1 --no-dump --json "$LOG/strata-prefill-$1.json" 2>&1 \
    | tee "$LOG/strata-prefill-$1.log" | grep -v "^\s*$" | tail -6
}

strata_short() {
  local l; need_gguf strata-short || return; for l in $(lengths short); do strata_prefill "$l" 120; done
}
strata_long() { local l; need_gguf strata-long || return; for l in $(lengths long); do strata_prefill "$l" 200; done; }
strata_decode() {
  need_gguf strata-decode || return
  fits "strata decode" 150 || return
  el "strata: decode $DECODE_TOKENS tokens after $DEPTHS (bench/generate.py)"
  timeout $(( $(left) + 20 )) $PY bench/generate.py --model "$GGUF" --devices "$SDEV" --contexts "$DEPTHS" \
    --tokens "$DECODE_TOKENS" --chunk "$CHUNK" --json "$LOG/strata-decode.json" 2>&1 \
    | tee "$LOG/strata-decode.log" | tail -5
}
strata() { need_gguf strata || return; strata_short; strata_decode; strata_long; }

table() {
  el "table: $PRESET $QTYPE, Strata beside llama.cpp"
  $PY - "$LOG" "$GGUF" "$LENGTHS" "$DEPTHS" <<'EOF'
import json, sys
from pathlib import Path
log, gguf = Path(sys.argv[1]), sys.argv[2]
lengths, depths = [int(x) for x in sys.argv[3].split(",")], [int(x) for x in sys.argv[4].split(",")]


def load(name):
    try:
        return json.loads((log / name).read_text())
    except (OSError, ValueError):
        return None


def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"


def num(v):
    return f"{v:,.1f}" if v else "-"


rows, facts = [], []
for n in lengths:
    s, ll = load(f"strata-prefill-{n}.json"), load(f"llama-prefill-{n}.json")
    st = (s or {}).get("d1") or {}
    lt = next((r["avg_ts"] for r in ll or [] if r.get("n_prompt") == n), None)
    rows.append((f"prefill {n}", st.get("tok_s"), lt))
    for g in st.get("stages") or []:
        per = g["kv_bytes"] / st["max_context"] if st.get("max_context") else None
        facts.append(f"Strata prefill {n:,}: stage {g['device']} layers {g['layers']}: kv_bytes {g['kv_bytes']:,} over "
                     f"{st.get('max_context') or 0:,} positions = {per:,.0f} B per token; peak "
                     f"{(g.get('peak_bytes') or 0) / 2**30:.2f} GiB (weights {g['weight_bytes'] / 2**30:.2f} GiB, "
                     f"load {st.get('load_wall_s') or 0:.1f} s)")
sd, ld = load("strata-decode.json") or [], load("llama-decode.json") or []
for d in depths:
    s = next((r for r in sd if r.get("arm") == "strata" and r["context"] == d), {})
    lt = next((r["avg_ts"] for r in ld if r.get("n_depth") == d and r.get("n_gen")), None)
    rows.append((f"decode after {d}", s.get("decode_tok_s"), lt))
    if s.get("peak_bytes"):
        facts.append(f"Strata decode after {d:,}: peak {max(s['peak_bytes']) / 2**30:.2f} GiB")
print(f"{gguf} on the device, Strata beside llama.cpp (tok/s; llama-bench -fa 1 -ub 2048)")
print("| what | Strata | llama.cpp | Strata / llama.cpp |")
print("|---|---:|---:|---:|")
for what, s, ll in rows:
    print(f"| {what} | {num(s)} | {num(ll)} | {ratio(s, ll)} |")
try:
    from strata.weights.checkpoint import model_args
    a = model_args(gguf)
    lay = a.n_layers * a.kv_values() * 2
    print(f"KV per token by the layout: Strata bfloat16 {lay:,} B ({a.n_layers} layers x {a.kv_values()} values: "
          f"[latent | roped key]); llama.cpp's deepseek2 cache f16 "
          f"{a.n_layers * (a.kv_lora_rank + a.qk_rope_dim) * 2:,} B (the same values, no V cache with MLA)")
except Exception as e:  # noqa: BLE001 - the table still prints
    print(f"(no args from {gguf}: {e})")
for f in facts:
    print(f)
EOF
}

STEPS="setup build gguf llama strata table llama-short llama-decode llama-long strata-short strata-decode strata-long"
for step in "$@"; do
  case " $STEPS " in
    *" $step "*) ${step//-/_} ;;
    *) echo "unknown step $step ($STEPS)"; exit 2 ;;
  esac
done
[ -n "$BUILD_PID" ] && build_wait
el end
