#!/usr/bin/env bash
# The seed's rig on one H200 (issue 26): four stages sharing cuda:0, capped and enforced at 12, 12, 8 and 8 GB
# (configs/seed.yaml), a Qwen3-32B shape with YaRN x4 as a random-block IQ3_S GGUF, 122,880 tokens, the q8_0 KV
# cache, layer_split and chunk auto; depth 1 then depth 0, each with its residual's md5 and each stage's bytes
# against its cap. Then `big`: the 70B IQ3_S on four stages capped at 16 GB each, the same prompt (it completes,
# or the planner's refusal says what would fit). Usage: bash bench/device_seed.sh [tests] [splitk] [measure] seed big
LOG=${LOG:-/tmp/seed}; mkdir -p "$LOG"
. bench/device_common.sh
wheels zmq gguf

# run NAME GGUF STAGES DEPTH: launcher.py on configs/seed.yaml with the stages and depth given, its report summed up
run() {
  el "$1: depth $4"
  timeout $(( $(left) + 20 )) python3 launcher.py --config configs/seed.yaml --set model="$2" --set "stages=$3" \
    --set depth="$4" --set 'prompt={random: {tokens: 122880, seed: 0}}' --set generate=0 --set dump_residual=true \
    --set progress=false $EXTRA --out "/tmp/$1-d$4" --json --no-timeline > "$LOG/$1-d$4.json" 2> "$LOG/$1-d$4.err"
  echo "launcher rc $?"; tail -2 "$LOG/$1-d$4.err"
  python3 - "$LOG/$1-d$4.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no report: {e}")
g = lambda b: f"{(b or 0) / 1e9:.2f}"
print(f"{r['tokens']:,} tokens in {r['seconds']:.2f} s = {r['tok_s']:,.1f} tok/s; depth {r['depth']}; chunk {r['chunk']} "
      f"({r['chunks']} chunks); split {r['split']}; md5 {r.get('residual_md5')}")
print("stage | layers | weights GB | kv GB | scratch GB | at load GB | prefill peak GB | planned GB | cap GB")
for s in r["stages"]:
    print(f"{s['index']} | {s['layers'][1] - s['layers'][0]} | {g(s['weight_bytes'])} | {g(s['kv_bytes'])} | {g(s['scratch_bytes'])} | "
          f"{g(s['mem_bytes'])} | {g(s.get('peak_bytes'))} | {g(s.get('need_bytes'))} | {g(s.get('cap_bytes'))}")
PY
  rm -f "/tmp/$1-d$4"/residual*.npy
  [ -n "$OUT" ] && mkdir -p "$OUT/$1-d$4" && cp "/tmp/$1-d$4"/*.log "$LOG/$1-d$4.err" "$OUT/$1-d$4/" 2>/dev/null
}

for step in "$@"; do case $step in
tests)
  el "GPU tests: resident layers (one group of matrices at a time in the scratch), experts"
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_moe_resident.py \
    -k "resident or quant or gguf or expert" 2>&1 | tail -4 ;;
splitk)
  el "split-K alone: bf16 and q8_0 caches, 122,880 keys (bench/splitk.py)"
  timeout 150 python3 bench/splitk.py --keys 122880 2>&1 | tail -40 ;;
probe)  # the plan's gap at load (bench/load_memory.py) and the 8-bit prefix attention's per-chunk cost
  [ -f /tmp/q32y-l8.gguf ] || timeout 120 python3 bench/make_gguf.py --preset qwen3-32b-yarn --qtype IQ3_S --layers 8 \
    --out /tmp/q32y-l8.gguf --device cuda 2>&1 | tail -1
  for L in 0:4 2:6 4:8; do timeout 120 python3 bench/load_memory.py --model /tmp/q32y-l8.gguf --layers $L 2>&1 | tail -16; done
  timeout 120 python3 bench/narrow_prefill.py 2>&1 | tail -6 ;;
profile)  # one 448-token chunk of 8 layers at position 110,000 with the q8_0 cache; the stage's memory at load
  [ -f /tmp/q32y-l8.gguf ] || timeout 120 python3 bench/make_gguf.py --preset qwen3-32b-yarn --qtype IQ3_S --layers 8 \
    --out /tmp/q32y-l8.gguf --device cuda 2>&1 | tail -1
  timeout 150 python3 bench/chunk_profile.py --model /tmp/q32y-l8.gguf --chunk 448 --kv q8_0 --at 110000 --chunks 3 \
    --profile 2>&1 | tail -24
  S='[{device: cuda:0, speed: 1}, {device: cuda:0, speed: 1}, {device: cuda:0, speed: 1}, {device: cuda:0, speed: 1}]'
  timeout 150 python3 launcher.py --config configs/seed.yaml --set model=/tmp/q32y-l8.gguf --set "stages=$S" \
    --set 'layer_split=[2,2,2,2]' --set chunk=448 --set max_context=131072 --set generate=0 --set progress=false \
    --set 'prompt={random: {tokens: 2048, seed: 0}}' --set 'debug={memory_trace: true}' --out /tmp/trace --json \
    --no-timeline > /dev/null 2> "$LOG/trace.err"; echo "launcher rc $?"; tail -2 "$LOG/trace.err"
  grep -h "GPU memory at load\|memory_trace" /tmp/trace/stage-*.log | cut -c 25- ;;
seed)
  el "gguf qwen3-32b-yarn IQ3_S"
  [ -f /tmp/q32y-iq3s.gguf ] || timeout 200 python3 bench/make_gguf.py --preset qwen3-32b-yarn --qtype IQ3_S \
    --out /tmp/q32y-iq3s.gguf --device cuda 2>&1 | tail -1
  S='[{device: cuda:0, memory: 12000000000}, {device: cuda:0, memory: 12000000000}, {device: cuda:0, memory: 8000000000}, {device: cuda:0, memory: 8000000000}]'
  run seed /tmp/q32y-iq3s.gguf "$S" 1
  fits "seed depth 0" 150 && run seed /tmp/q32y-iq3s.gguf "$S" 0 ;;
measure)  # the seed's split and chunk without the caps: each stage's prefill peak against the plan's need
  [ -f /tmp/q32y-iq3s.gguf ] || timeout 200 python3 bench/make_gguf.py --preset qwen3-32b-yarn --qtype IQ3_S \
    --out /tmp/q32y-iq3s.gguf --device cuda 2>&1 | tail -1
  S='[{device: cuda:0, speed: 1}, {device: cuda:0, speed: 1}, {device: cuda:0, speed: 1}, {device: cuda:0, speed: 1}]'
  SPLIT=${SPLIT:-[20,20,13,11]} CHUNK=${CHUNK:-448}
  EXTRA="--set layer_split=$SPLIT --set chunk=$CHUNK" run measure /tmp/q32y-iq3s.gguf "$S" 1 ;;
big)
  el "gguf llama-3-70b IQ3_S"
  [ -f /tmp/70b-iq3s.gguf ] || timeout 200 python3 bench/make_gguf.py --preset llama-3-70b --qtype IQ3_S \
    --out /tmp/70b-iq3s.gguf --device cuda 2>&1 | tail -1
  S='[{device: cuda:0, memory: 16000000000}, {device: cuda:0, memory: 16000000000}, {device: cuda:0, memory: 16000000000}, {device: cuda:0, memory: 16000000000}]'
  run big /tmp/70b-iq3s.gguf "$S" 1 ;;
esac; done
el end
