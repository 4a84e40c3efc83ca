#!/usr/bin/env bash
# Qwen3.5 (hybrid: Gated DeltaNet + gated full attention) on one H200 beside llama.cpp (issue 28's GPU acceptance):
#   setup    the carried wheels (.whl: pyzmq, gguf, fla-core, einops) into /tmp/site; checks fla's gated delta rule
#            imports (every call: PYTHONPATH is per call)
#   build    llama.cpp (llama-bench, CUDA sm_90) from the carried .peer/llama.tgz into /tmp/ll, in the background at
#            nice 19 while the tests and the GGUF write run; waited for before any timed step
#   tests    pytest -m gpu tests/test_linear_attention.py (fla against the torch chunked form, the step in a CUDA
#            graph, a tiny Qwen3.5 on CUDA against the CPU path), tests/test_resident_linear.py (a tiny Q4_K_M qwen35
#            file resident: prefill against the dequantized slices, decode graphs on the blocks against eager), then
#            tests/test_families.py -k qwen3_5 (the decode graphs against eager in bf16, dense and MoE, and sliced)
#   gguf     a random-block Q4_K_M GGUF of qwen3.5-27b (bench/make_gguf.py --device cuda; 15.8 GiB)
#   prefill  bench/peer.py prefill of 262,144 tokens (the preset's whole context), chunk 10,240: llama-bench on the
#            file, and Strata on synthetic:qwen3.5-27b in bfloat16 (the same shapes; Strata holds linear-attention
#            models dense, and loading the file dequantizes all of it on the host first: ~100 GB of float32 for this
#            shape, so the file arm is left out); prints each stage's kv_bytes and state_bytes from the report
#   decode   bench/generate.py decode after 2,048 and 32,768 tokens, 128 each: Strata on synthetic:qwen3.5-27b
#            bfloat16 (dense; decode graphs), llama-bench -d on the file
#   resident bench/peer.py prefill of 262,016 tokens, chunk 10,240, on the file itself: llama-bench and Strata with
#            the file held resident (weights auto: Q4_K_M blocks, one layer's group dequantized at a time), then 128
#            generated tokens after the whole prompt (Strata's decode at 262,144; llama-bench's -n 128 is at depth 0)
#   rdecode  bench/generate.py decode after 2,048 and 32,768 tokens, 128 each, on the file held resident: Strata with
#            the decode graphs (products on the blocks) and without (eager), llama-bench -d on the same file
#   ldecode  llama-bench's decode of 128 tokens after 262,016 on the file (-d; its depth prefilled with -ub 2048), beside
#            the resident step's Strata decode after the same prompt (~250 s)
#   million  bench/peer.py prefill of 1,048,576 tokens of synthetic:qwen3.5-9b-yarn in bfloat16 (Qwen3.5-9B's shape with
#            Qwen's YaRN x4 over 262,144), chunk 10,240; prints each stage's kv_bytes and state_bytes (no llama.cpp arm)
# Run from the repo root on the GPU machine, carrying .peer/llama.tgz and .whl:
#   bash bench/device_qwen35.sh setup build tests gguf        # first call (~450 s: the build ~330 in the background)
#   bash bench/device_qwen35.sh setup prefill                 # second call, at once (the build and the file in /tmp
#   bash bench/device_qwen35.sh setup decode                  # survive on a warm machine, ~30 s after a call)
#   bash bench/device_qwen35.sh setup resident                # the file resident beside llama-bench (~420 s)
#   bash bench/device_qwen35.sh setup rdecode                 # decode on the file resident (~300 s)
# Steps already done (llama-bench built, the GGUF written) are skipped. DEADLINE (seconds since the start, default
# 570) skips a step whose usual time would pass it: the call ends inside the device's 600 s and names what it left.
# Logs and the peer JSON go to $OUT (the device's returned folder) or /tmp/q35-logs.
Q35=${Q35:-/tmp/q35-27b-q4km.gguf}
PRESET=qwen3.5-27b
LOG=${OUT:-/tmp/q35-logs}; mkdir -p "$LOG"
. "$(dirname "$0")/device_common.sh"  # el, left, fits, wheels, build, build_wait

setup() {
  wheels zmq gguf fla einops
  el "setup: $(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))')"
  python3 -c 'import fla; from fla.ops.gated_delta_rule import chunk_gated_delta_rule; print("fla", fla.__version__)' 2>&1 \
    | tail -1
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  df -h /tmp | tail -1
}

tests() {
  fits tests 150 || return
  el "tests: pytest -m gpu tests/test_linear_attention.py; tests/test_families.py -k qwen3_5"
  timeout $(( $(left) - 60 )) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_linear_attention.py \
    tests/test_resident_linear.py 2>&1 | tee "$LOG/tests-linear.log" | tail -20
  fits "tests (families)" 90 || return
  timeout $(( $(left) - 10 )) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_families.py -k qwen3_5 2>&1 \
    | tee "$LOG/tests-families.log" | tail -12
}

gguf() {
  if [ -s "$Q35" ]; then el "gguf: $Q35 exists"; return; fi
  fits "gguf $PRESET" 120 || return 1
  el "gguf: $PRESET Q4_K_M -> $Q35"
  timeout 300 python3 bench/make_gguf.py --preset "$PRESET" --qtype Q4_K_M --out "$Q35.part" --device cuda 2>&1 \
    | tail -1 && mv "$Q35.part" "$Q35"
  ls -la "$Q35" 2>&1; df -h /tmp | tail -1
}

bf16_stages() {  # a peer JSON's bf16 arm: its time, and each stage's KV beside every layer's, its state and memory
  python3 - "$@" <<'EOF'
import json, sys
path, label, layers, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
try:
    b = json.load(open(path)).get("bf16", {})
except Exception as e:
    sys.exit(f"no peer JSON: {e}")
full = layers * 2 * 4 * 256 * tokens * 2  # K and V of every layer (4 kv heads of 256) over the whole context, bf16
print(f"{label}: {b.get('tok_s')} tok/s; {b.get('seconds')} s; load {b.get('load_wall_s')} s")
for s in b.get("stages", []):
    print(f"{label} stage {s['device']} layers {s['layers']}: kv_bytes {s['kv_bytes']:,} "
          f"({s['kv_bytes'] / 2**30:.2f} GiB; every layer's bf16 KV would be {full / 2**30:.2f} GiB), "
          f"state_bytes {s['state_bytes']:,} ({s['state_bytes'] / 2**20:.1f} MiB); "
          f"weights {s['weight_bytes'] / 2**30:.2f} GiB; mem {s['mem_bytes'] / 2**30:.2f} GiB")
EOF
}

prefill() {
  [ -s "$Q35" ] || { el "prefill: no $Q35 (run the gguf step first)"; return 1; }
  fits prefill 300 || return
  el "prefill: 262,144 tokens, llama-bench on the file beside Strata bf16 on the same shape (bench/peer.py)"
  local lb=(); build_wait && lb=(--llama-bench "$LB")
  # (--llama-no-warmup: llama-bench's warm-up is a whole 262,144-token run, which would double its time)
  timeout $(( $(left) + 20 )) python3 bench/peer.py --preset "$PRESET" --qtype Q4_K_M --devices cuda:0 --tokens 262144 \
    --chunk 10240 --gguf "$Q35" "${lb[@]}" --llama-no-warmup --arms llama,bf16 --no-dump --json "$LOG/q35-peer.json" \
    2>&1 | tee "$LOG/q35-prefill.log" | grep -v "^\s*$" | tail -8
  bf16_stages "$LOG/q35-peer.json" "$PRESET" 64 262144
}

decode() {
  [ -s "$Q35" ] || { el "decode: no $Q35 (run the gguf step first)"; return 1; }
  fits decode 200 || return
  el "decode: after 2,048 and 32,768 tokens, 128 each (bench/generate.py; llama-bench on the file)"
  local lb=(); build_wait && lb=(--llama-bench "$LB" --llama-gguf "$Q35")
  timeout $(( $(left) + 20 )) python3 bench/generate.py --model "synthetic:$PRESET" --dtype bfloat16 --devices cuda:0 \
    --contexts 2048,32768 --tokens 128 --chunk 10240 "${lb[@]}" 2>&1 | tee "$LOG/q35-decode.log" | tail -8
}

resident() {
  [ -s "$Q35" ] || { el "resident: no $Q35 (run the gguf step first)"; return 1; }
  fits resident 420 || return
  # 262,016 + 128 generated = the preset's whole context (262,144 + 128 is refused by the planner)
  el "resident: 262,016 tokens on the file held resident, llama-bench beside it, then 128 tokens (bench/peer.py)"
  local lb=(); build_wait && lb=(--llama-bench "$LB")
  timeout $(( $(left) + 20 )) python3 bench/peer.py --preset "$PRESET" --qtype Q4_K_M --devices cuda:0 --tokens 262016 \
    --chunk 10240 --gguf "$Q35" "${lb[@]}" --llama-no-warmup --arms llama,d1 --no-dump --decode 128 \
    --json "$LOG/q35-resident.json" 2>&1 | tee "$LOG/q35-resident.log" | grep -v "^\s*$" | tail -10
  python3 - "$LOG/q35-resident.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no peer JSON: {e}")
d = r.get("d1", {})
print(f"resident: decode after 262,016 tokens {d.get('decode_tok_s')} tok/s; load {d.get('load_wall_s')} s")
for s in d.get("stages", []):
    print(f"qwen3.5-27b Q4_K_M resident, stage {s['device']} layers {s['layers']}: weights {s['weight_bytes'] / 2**30:.2f} "
          f"GiB; kv_bytes {s['kv_bytes'] / 2**30:.2f} GiB; state_bytes {s['state_bytes'] / 2**20:.1f} MiB; "
          f"mem {s['mem_bytes'] / 2**30:.2f} GiB")
EOF
}

rdecode() {
  [ -s "$Q35" ] || { el "rdecode: no $Q35 (run the gguf step first)"; return 1; }
  fits rdecode 300 || return
  el "rdecode: the file resident, after 2,048 and 32,768 tokens, 128 each, graphs and eager (bench/generate.py)"
  local lb=(); build_wait && lb=(--llama-bench "$LB")
  timeout $(( $(left) + 20 )) python3 bench/generate.py --model "$Q35" --dtype bfloat16 --devices cuda:0 \
    --contexts 2048,32768 --tokens 128 --chunk 10240 --cuda-graphs true,false "${lb[@]}" 2>&1 \
    | tee "$LOG/q35-rdecode.log" | tail -14
}

ldecode() {
  [ -s "$Q35" ] || { el "ldecode: no $Q35 (run the gguf step first)"; return 1; }
  fits ldecode 260 || return
  build_wait || { el "ldecode: no llama-bench"; return 1; }
  el "ldecode: llama-bench, 128 tokens after 262,016 on the file"
  timeout $(( $(left) + 20 )) "$LB" -m "$Q35" -ngl 99 -fa 1 -b 2048 -ub 2048 -p 0 -n 128 -d 262016 -r 1 -o json \
    > "$LOG/q35-ldecode.json" 2> "$LOG/q35-ldecode.err"
  python3 - "$LOG/q35-ldecode.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))[0]
except Exception as e:
    sys.exit(f"no llama-bench JSON: {e}")
print(f"llama.cpp qwen3.5-27b Q4_K_M: decode of {r['n_gen']} after {r['n_depth']:,}: {r['avg_ts']:.1f} tok/s")
EOF
}

million() {
  fits million 420 || return
  el "million: 1,048,576 tokens of synthetic:qwen3.5-9b-yarn, bf16, chunk 10,240 (bench/peer.py)"
  timeout $(( $(left) + 20 )) python3 bench/peer.py --preset qwen3.5-9b-yarn --devices cuda:0 --tokens 1048576 \
    --chunk 10240 --arms bf16 --no-dump --json "$LOG/q35-million.json" 2>&1 | tee "$LOG/q35-million.log" \
    | grep -v "^\s*$" | tail -8
  bf16_stages "$LOG/q35-million.json" qwen3.5-9b-yarn 32 1048576
}

STEPS="setup build tests gguf prefill decode resident rdecode ldecode million"
for step in ${@:-setup build tests gguf}; do
  case " $STEPS " in
    *" $step "*) $step ;;
    *) echo "unknown step $step ($STEPS)"; exit 2 ;;
  esac
done
[ -n "$BUILD_PID" ] && build_wait
el end
