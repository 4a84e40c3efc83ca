#!/usr/bin/env bash
# Decode beside llama.cpp in one device call: 8B bf16 with CUDA graphs (decode doorbells on, the default, then off) and 70B
# IQ3_S resident, both on 2 GPUs;
# picks the fastest accurate IQ3_S matrix-vector kernel first (bench/pick_iq3s.py). BENCHMARKS.md's decode rows.
# run from the repo root on a 2-GPU machine with wheels installed and llama-bench built (see ../shared/tools/llamacpp-peer.sh);
# LB: path to llama-bench
LB=${LB:-/tmp/ll/build/bin/llama-bench}
t0=$(date +%s); el() { echo "=== [+$(( $(date +%s) - t0 )) s] $*"; }
el gguf 8B F16, 70B IQ3_S
timeout 60 python3 bench/make_gguf.py --preset llama-3-8b --qtype F16 --out /tmp/8b-f16.gguf --device cuda 2>&1 | tail -1
timeout 90 python3 bench/make_gguf.py --preset llama-3-70b --qtype IQ3_S --out /tmp/70b-iq3s.gguf --device cuda 2>&1 | tail -1
el tests
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_attention.py tests/test_gpu.py tests/test_quant_gemv.py -k "split or graph or block_decode or capture" 2>&1 | tail -3
el pick IQ3_S kernel
export STRATA_GEMV_IQ3S=$(timeout 40 python3 bench/pick_iq3s.py); echo "IQ3_S kernel: $STRATA_GEMV_IQ3S"
el 8B decode 2 GPUs, with llama.cpp
timeout 110 python3 bench/generate.py --model synthetic:llama-3-8b --devices cuda:0,cuda:1 --contexts 2048,32768 --tokens 128 --llama-bench $LB --llama-gguf /tmp/8b-f16.gguf 2>&1 | tail -6
el "8B decode 2 GPUs, decode doorbells off (ZeroMQ notes): strata/comm/bells.py's A/B against the row above"
STRATA_DECODE_BELLS=0 timeout 110 python3 bench/generate.py --model synthetic:llama-3-8b --devices cuda:0,cuda:1 --contexts 2048,32768 --tokens 128 2>&1 | tail -4
el 70B IQ3_S resident decode 2 GPUs, with llama.cpp
timeout 150 python3 bench/generate.py --model /tmp/70b-iq3s.gguf --devices cuda:0,cuda:1 --contexts 2048 --tokens 64 --llama-bench $LB 2>&1 | tail -4
el end
