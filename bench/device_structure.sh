#!/usr/bin/env bash
# Issue 55's A/B on one GPU: main before the structure work against this tree, in the same call. The base is a copy
# of the old commit's strata/ workers/ bench/ configs/ launcher.py in .base/ (made here by `base`, carried), each
# arm run from its own tree. Steps:
#   setup     the carried wheels; llama.cpp's CUDA build in the background (nice 19, waited for before timing)
#   base      (here, not on the device) BASE=<commit> bash bench/device_structure.sh base: write .base/
#   ggufs     random-block Q4_K_M files: the 8B (decode and server A/B), and 4-layer slices of one preset per family
#   bits      each family's slice through launcher.py in both trees (bf16, 3 chunks, 8 greedy tokens by the decode
#             graphs): residual md5, perplexity and tokens side by side; then the 8B's
#   decode    bench/generate.py: decode after 2,048 and 122,880 tokens (8B Q4_K_M), base, this tree, base, this
#             tree; then llama-bench's decode at the same depths on the same file
#   serve     bench/serve_concurrency.py: 16 streams of 32-id prompts, 128 tokens (max_seqs 16), base, this tree,
#             base, this tree, the first pair beside llama-batched-bench
#   layer     bench/device_layer.sh against .base: the GPU tests of the layer and graphs, then the graph replays' and
#             the eager CUDA paths' outputs per family, both trees compared bit for bit
#   gpu-tests pytest -m gpu on this tree's GPU tests
# PAIRS (default 2): the base / this tree pairs of `decode` and `serve`.
# Usage (carry .whl .peer .base): bash bench/device_structure.sh setup layer ggufs   (first call)
#                                 bash bench/device_structure.sh setup decode serve  (second call, at once)
LOG=${LOG:-/tmp/structure}; mkdir -p "$LOG"
if [ "${1:-}" = base ]; then  # (here) the base tree, from git
  rm -rf .base && mkdir .base && git archive "${BASE:?BASE=<commit>}" strata workers bench configs launcher.py \
    | tar -x -C .base && ex=$(git rev-parse --git-path info/exclude) && { grep -qx /.base/ "$ex" || echo /.base/ >> "$ex"; }
  echo ".base/ = $BASE"; exit 0
fi
. bench/device_common.sh
wheels zmq gguf
FAM=${FAM-llama-3-8b qwen3-8b gemma-3-27b qwen3-30b-a3b gpt-oss-20b qwen3.5-9b}  # (FAM= : the 8B file alone)
bits_rig() {  # PRESET FILE -> a rig on one GPU, bf16, three chunks and 8 tokens of greedy decode
  cat > "/tmp/bits-$1.yaml" <<YAML
model: $2
dtype: ${DTYPE:-bfloat16}
stages: [{device: "${DEVICE:-cuda:0}"}]
chunk: 512
prompt: {random: {tokens: 1400, seed: 1}}
generate: 8
dump_residual: true
YAML
}
bits_one() {  # NAME TREE RIG
  local out=/tmp/bits-out/$1-$(basename "$2"); rm -rf "$out"
  (cd "$2" && PYTHONPATH="$2:${PYTHONPATH:-}" timeout 120 python3 launcher.py --config "$3" --out "$out" \
     --no-timeline > "$out.log" 2>&1) || { echo "$1 $(basename "$2"): failed"; tail -3 "$out.log"; return; }
  python3 - "$out" "$1" "$(basename "$2")" <<'PY'
import glob, json, sys
r = json.load(open(glob.glob(sys.argv[1] + "/**/report.json", recursive=True)[0]))
print(f"{sys.argv[2]:<14} {sys.argv[3]:<10} md5 {r['residual_md5']}  ppl {r['perplexity']:.8g}  "
      f"tokens {r.get('continuation_ids')}")
PY
}
for step in "$@"; do case $step in
setup) build ;;
ggufs)
  el "the 8B Q4_K_M file, then 4-layer slices of each family"
  [ -f /tmp/8b-q4km.gguf ] || timeout 120 python3 bench/make_gguf.py --preset llama-3-8b --qtype Q4_K_M \
    --out /tmp/8b-q4km.gguf --device cuda 2>&1 | tail -1
  for p in $FAM; do
    q=Q4_K_M; [ "$p" = gpt-oss-20b ] && q=MXFP4_MOE
    [ -f "/tmp/fam-$p.gguf" ] || timeout 100 python3 bench/make_gguf.py --preset "$p" --qtype $q --layers 4 \
      --out "/tmp/fam-$p.gguf" --device "${DEVICE:-cuda}" 2>&1 | tail -1
  done ;;
bits)
  el "same bits: each family's 4-layer slice (resident Q4_K_M), base then this tree"
  mkdir -p /tmp/bits-out
  for p in $FAM; do
    fits "bits $p" 50 || break
    bits_rig "$p" "/tmp/fam-$p.gguf"
    for tree in "$PWD/.base" "$PWD"; do bits_one "$p" "$tree" "/tmp/bits-$p.yaml"; done
  done 2>&1 | tee "$LOG/bits.log" ;;
decode)
  build_wait
  for tree in $(for _ in $(seq "${PAIRS:-2}"); do echo "$PWD/.base $PWD"; done); do
    fits "decode $(basename "$tree")" 100 || break
    el "decode after 2,048 and 122,880 tokens, 8B Q4_K_M, 1 GPU: $(basename "$tree")"
    (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" timeout 200 python3 bench/generate.py --model /tmp/8b-q4km.gguf \
      --devices cuda:0 --contexts 2048,122880 --tokens 128 --chunk 10240 2>&1 | tail -3)
  done 2>&1 | tee "$LOG/decode.log"
  [ -x "$LB" ] && fits "llama.cpp decode" 120 && { el "llama.cpp decode, the same file and depths"
    timeout 200 python3 bench/generate.py --model /tmp/8b-q4km.gguf --devices cuda:0 --contexts 2048,122880 \
      --tokens 128 --llama-only --llama-bench "$LB" 2>&1 | tail -3; } | tee -a "$LOG/decode.log" ;;
serve)
  build_wait
  wheels uvicorn starlette httpx
  peer="$LL/build/bin/llama-batched-bench"; [ -x "$peer" ] || peer=''
  for tree in $(for _ in $(seq "${PAIRS:-2}"); do echo "$PWD/.base $PWD"; done); do
    fits "serve $(basename "$tree")" 90 || break
    el "the server, 16 streams, 8B Q4_K_M, 1 GPU: $(basename "$tree")"
    (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" timeout 200 python3 bench/serve_concurrency.py \
      --model /tmp/8b-q4km.gguf --devices cuda:0 --prompt-ids 32 --streams 16 --max-seqs 16 --tokens 128 \
      --max-context 4096 --peer "$peer" 2>&1 | tail -3)
    peer=''
  done 2>&1 | tee "$LOG/serve.log" ;;
layer)
  el "the one layer body on CUDA: GPU tests, graph and eager outputs against .base"
  OUT=$LOG/layer PY=python3 timeout "$(( $(left) - 60 ))" bash bench/device_layer.sh "$PWD/.base" 2>&1 | tee "$LOG/layer.log" ;;
gpu-tests)
  el "GPU tests of this tree"
  timeout "$(( $(left) - 10 ))" python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tail -15 ;;
*) echo "unknown step $step"; exit 2 ;;
esac; done
