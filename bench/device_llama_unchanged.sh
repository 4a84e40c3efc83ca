#!/usr/bin/env bash
# One device call: the GPU tests of the families and kernels, the Llama-3-8B shape at 843d5ab (carried as
# .peer/old.tar from `git archive --prefix=old/ 843d5ab`) and at this tree side by side, and gemma-3-27b's decode path.
# Run from the repo root on the GPU machine carrying .whl and .peer/old.tar. PYTEST: other GPU test arguments
# (default the families and decode attention files); GEMMA=0 leaves out the gemma step.
set -o pipefail
t0=$(date +%s); el() { echo "=== [+$(( $(date +%s) - t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p /tmp/old && tar xf .peer/old.tar -C /tmp/old
el "gpu tests: ${PYTEST:-tests/test_families.py tests/test_decode_attention.py}"
eval "timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider ${PYTEST:-tests/test_families.py tests/test_decode_attention.py}" 2>&1 | tail -4
for tree in /tmp/old/old $PWD; do
  el "8B bf16 synthetic, $tree: prefill 32,768 then decode after 2,048"
  (cd $tree && PYTHONPATH=$tree:/tmp/site timeout 100 python3 launcher.py --config configs/rig.yaml --set model=synthetic:llama-3-8b --set dtype=bfloat16 --set 'stages=[cuda:0]' --set chunk=8192 --set 'prompt={random: {tokens: 32768, seed: 0}}' --set generate=0 --set perplexity=false --set dump_residual=true --set progress=false --out /tmp/r-$(basename $tree) --no-timeline > /tmp/r-$(basename $tree).log 2>&1; python3 -c "import json,glob; r=json.load(open(glob.glob('/tmp/r-$(basename $tree)/**/report.json', recursive=True)[0])); print('prefill tok/s', round(r['tok_s'],1), 'md5', r['residual_md5'])" || tail -5 /tmp/r-$(basename $tree).log)
  (cd $tree && PYTHONPATH=$tree:/tmp/site timeout 100 python3 bench/generate.py --model synthetic:llama-3-8b --devices cuda:0 --contexts 2048 --tokens 256 2>&1 | tail -2)
done
[ "${GEMMA:-1}" = 0 ] && { el end; exit 0; }
el "gemma-3-27b Q4_K_M: the decode path and its speed"
timeout 60 python3 bench/make_gguf.py --preset gemma-3-27b --qtype Q4_K_M --out /tmp/g27.gguf --device cuda 2>&1 | tail -1
timeout 150 python3 bench/generate.py --model /tmp/g27.gguf --devices cuda:0 --contexts 2048 --tokens 128 2>&1 | tail -2
find / -name "stage-*.log" -newer /tmp/old 2>/dev/null | xargs grep -h "decode: " 2>/dev/null | sed 's/^.*decode: /decode: /' | sort | uniq -c | head
el end
