#!/usr/bin/env bash
# The new families on one H200 beside llama.cpp, in one or two device calls (BENCHMARKS.md's families rows):
#   setup   the carried wheels (.whl: pyzmq, gguf) into /tmp/site            (every call: PYTHONPATH is per call)
#   build   llama.cpp (llama-bench, CUDA sm_90) from the carried .peer/llama.tgz into /tmp/ll, in the background
#           at nice 19 while the GPU tests and the GGUF writes run; waited for before any timed step
#   tests   pytest -m gpu tests/test_families.py
#   gpu-tests  pytest -m gpu $PYTEST (the test files and -k a change touched)
#   gguf    random-block Q4_K_M GGUFs of qwen3-32b and gemma-3-27b (bench/make_gguf.py --device cuda)
#   qwen32  bench/peer.py prefill of 40,960 tokens (the preset's whole context), chunk 10,240 (qwen32-prefill),
#           then bench/generate.py decode after 2,048 and 32,768 tokens (qwen32-decode), each beside llama-bench
#           on the same file
#   gemma   the same for gemma-3-27b with a 122,880-token prefill (gemma-prefill, which also prints the stage's
#           kv_bytes from the report) and decode (gemma-decode)
#   yarn    synthetic:qwen3-8b-yarn bf16: launcher.py prefill of 131,072 tokens, then decode after 130,944
#           (prompt + generated tokens must fit the model's 131,072 positions)
#   moe-tests  pytest -m gpu tests/test_moe_resident.py tests/test_families.py -k "moe or mixtral or oss"
#   moe-gguf   qwen3-30b-a3b Q4_K_M and gpt-oss-20b MXFP4_MOE random-block GGUFs
#   q30     (q30-prefill, q30-decode) qwen3-30b-a3b: prefill of 122,880 tokens, decode after 2,048 and 32,768
#   oss     (oss-prefill, oss-decode) the same for gpt-oss-20b
#   dense-probe  the same on the qwen3-32b and gemma-3-27b files
#   probe   bench/decode_probe.py on both files: whether the decode graphs take the step, its graph and eager
#           times, the eager step's top CUDA kernels
#   moe-profile  bench/moe_profile.py on both files: where the 122,880-token prefill's time goes (oss-profile:
#           gpt-oss-20b's only)
# Run from the repo root on the GPU machine, carrying .peer/llama.tgz and .whl:
#   bash bench/device_families.sh setup build tests gguf qwen32-prefill   # first call (~450 s: the build ~330)
#   bash bench/device_families.sh setup qwen32-decode gemma               # second call, at once (the build and
#   bash bench/device_families.sh setup yarn                              # the files in /tmp survive on a warm
#                                                                         # machine, ~30 s after a call)
# Steps already done (llama-bench built, a GGUF written) are skipped. DEADLINE (seconds since the start, default
# 570) skips a step whose usual time would pass it: the call ends inside the device's 600 s and names what it left.
# Logs and the peer JSONs go to $OUT (the device's returned folder) or /tmp/fam-logs.
Q32=${Q32:-/tmp/q32-q4km.gguf}; G27=${G27:-/tmp/g27-q4km.gguf}; Q30=${Q30:-/tmp/q30a3-q4km.gguf}
OSS=${OSS:-/tmp/oss20-mxfp4.gguf}
LOG=${OUT:-/tmp/fam-logs}; mkdir -p "$LOG"
. "$(dirname "$0")/device_common.sh"  # el, left, fits, wheels, build, build_wait

setup() {
  wheels zmq gguf
  el "setup: $(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))')"
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  df -h /tmp | tail -1
}

tests() {
  fits tests 150 || return
  el "tests: pytest -m gpu tests/test_families.py"
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_families.py 2>&1 | tee "$LOG/tests.log" | tail -25
}

gguf1() {  # PRESET FILE [QTYPE]
  if [ -s "$2" ]; then el "gguf: $2 exists"; return; fi
  fits "gguf $1" 100 || return 1
  el "gguf: $1 ${3:-Q4_K_M} -> $2"
  timeout 300 python3 bench/make_gguf.py --preset "$1" --qtype "${3:-Q4_K_M}" --out "$2.part" --device cuda 2>&1 \
    | tail -1 && mv "$2.part" "$2"
}

gguf() { gguf1 qwen3-32b "$Q32"; gguf1 gemma-3-27b "$G27"; ls -la "$Q32" "$G27" 2>&1; df -h /tmp | tail -1; }
moe_gguf() { gguf1 qwen3-30b-a3b "$Q30"; gguf1 gpt-oss-20b "$OSS" MXFP4_MOE; ls -la "$Q30" "$OSS" 2>&1; df -h /tmp | tail -1; }

gpu_tests() {  # PYTEST: the arguments after pytest -q -m gpu (the tests a change touched)
  fits gpu-tests 120 || return
  el "gpu-tests: pytest -q -m gpu $PYTEST"
  eval "timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider $PYTEST" 2>&1 | tee "$LOG/gpu-tests.log" | tail -25
}

moe_tests() {
  fits moe-tests 150 || return
  el "moe-tests: pytest -m gpu tests/test_moe_resident.py tests/test_families.py -k 'moe or mixtral or oss'"
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_moe_resident.py tests/test_families.py \
    -k "moe or mixtral or oss" 2>&1 | tee "$LOG/moe-tests.log" | tail -25
}

peer_prefill() {  # NAME PRESET FILE TOKENS EST_S [QTYPE]
  fits "$1 prefill" "$5" || return
  el "$1: prefill $4 tokens, Strata beside llama.cpp (bench/peer.py)"
  local lb=(); build_wait && lb=(--llama-bench "$LB")
  timeout $(( $(left) + 20 )) python3 bench/peer.py --preset "$2" --qtype "${6:-Q4_K_M}" --devices cuda:0 --tokens "$4" \
    --chunk 10240 --gguf "$3" "${lb[@]}" --arms llama,d1 --no-dump --json "$LOG/$1-peer.json" 2>&1 \
    | tee "$LOG/$1-prefill.log" | grep -v "^\s*$" | tail -8
}

decode() {  # NAME FILE EST_S
  fits "$1 decode" "$3" || return
  el "$1: decode after 2,048 and 32,768 tokens, 128 each (bench/generate.py)"
  local lb=(); build_wait && lb=(--llama-bench "$LB")
  timeout $(( $(left) + 20 )) python3 bench/generate.py --model "$2" --devices cuda:0 --contexts "${CONTEXTS:-2048,32768}" --tokens 128 \
    "${lb[@]}" 2>&1 | tee "$LOG/$1-decode.log" | tail -8
}

qwen32_prefill() { peer_prefill qwen32 qwen3-32b "$Q32" 40960 120; }
qwen32_decode() { decode qwen32 "$Q32" 150; }
qwen32() { qwen32_prefill; qwen32_decode; }

gemma_prefill() {
  peer_prefill gemma27 gemma-3-27b "$G27" 122880 200
  python3 - "$LOG/gemma27-peer.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no peer JSON for gemma: {e}")
for s in r.get("d1", {}).get("stages", []):
    full = 62 * 2 * 16 * 128 * 131072 * 2  # every layer's K and V over the whole context in bf16
    print(f"gemma-3-27b stage {s['device']} layers {s['layers']}: kv_bytes {s['kv_bytes']:,} "
          f"({s['kv_bytes'] / 2**30:.2f} GiB; a full bf16 cache of all 62 layers x 131,072 positions: "
          f"{full / 2**30:.2f} GiB); weights {s['weight_bytes'] / 2**30:.2f} GiB; mem {s['mem_bytes'] / 2**30:.2f} GiB")
EOF
}
gemma_decode() { decode gemma27 "$G27" 200; }
gemma() { gemma_prefill; gemma_decode; }

yarn() {
  fits "yarn prefill" 90 || return
  el "yarn: synthetic:qwen3-8b-yarn bf16, launcher.py prefill of 131,072 tokens"
  timeout $(( $(left) + 20 )) python3 launcher.py --config configs/rig.yaml --set model=synthetic:qwen3-8b-yarn \
    --set dtype=bfloat16 --set 'stages=[cuda:0]' --set chunk=10240 --set 'prompt={random: {tokens: 131072, seed: 0}}' \
    --set generate=0 --set perplexity=false --set dump_residual=false --set progress=false --out /tmp/yarn-prefill \
    --json --no-timeline > "$LOG/yarn-prefill.json" 2> "$LOG/yarn-prefill.err"; echo "launcher rc $?"; tail -3 "$LOG/yarn-prefill.err"
  python3 - "$LOG/yarn-prefill.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no report: {e}")
print(f"qwen3-8b-yarn prefill: {r['tokens']:,} tokens in {r['seconds']:.2f} s = {r['tok_s']:,.1f} tok/s; "
      f"kv_bytes {[s.get('kv_bytes') for s in r['stages']]}; max_context {r['max_context']:,}")
EOF
  fits "yarn decode" 90 || return
  el "yarn: decode after 130,944 tokens, 127 generated (bench/generate.py)"
  timeout $(( $(left) + 20 )) python3 bench/generate.py --model synthetic:qwen3-8b-yarn --devices cuda:0 --contexts 130944 \
    --tokens 127 --chunk 10240 2>&1 | tee "$LOG/yarn-decode.log" | tail -4
}

q30_prefill() { peer_prefill q30 qwen3-30b-a3b "$Q30" 122880 150; }
q30_decode() { decode q30 "$Q30" 120; }
q30() { q30_prefill; q30_decode; }
oss_prefill() { peer_prefill oss20 gpt-oss-20b "$OSS" 122880 150 MXFP4_MOE; }
oss_decode() { decode oss20 "$OSS" 150; }
oss() { oss_prefill; oss_decode; }

moe_profile() { profile "$Q30" "$OSS"; }
probe() { probe_files "$Q30" "$OSS"; }
dense_probe() { probe_files "$Q32" "$G27"; }
probe_files() {  # one stage's decode step: graphs taken or not, graph and eager times, the eager step's top kernels
  local f
  for f in "$@"; do
    fits "probe $f" 60 || return
    el "probe: $f (bench/decode_probe.py, context 2,048)"
    timeout $(( $(left) + 20 )) python3 bench/decode_probe.py --model "$f" --context 2048 2>&1 \
      | tee "$LOG/probe-$(basename "$f" .gguf).log" | tail -30
  done
}
oss_profile() { profile "$OSS"; }
profile() {
  local f
  for f in "$@"; do
    fits "moe-profile $f" 90 || return
    el "moe-profile: $f"
    timeout $(( $(left) + 20 )) python3 bench/moe_profile.py --model "$f" --tokens 122880 --chunk 10240 2>&1 \
      | tee "$LOG/profile-$(basename "$f" .gguf).log" | tail -12
  done
}

STEPS="setup build tests gpu-tests gguf qwen32 qwen32-prefill qwen32-decode gemma gemma-prefill gemma-decode yarn moe-tests
moe-gguf q30 q30-prefill q30-decode oss oss-prefill oss-decode moe-profile oss-profile probe dense-probe"
for step in ${@:-setup build tests gguf qwen32 gemma yarn}; do
  case " ${STEPS//$'\n'/ } " in
    *" $step "*) ${step//-/_} ;;
    *) echo "unknown step $step ($STEPS)"; exit 2 ;;
  esac
done
[ -n "$BUILD_PID" ] && build_wait
el end
