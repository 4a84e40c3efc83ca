"""Times each IQ3_S gemv kernel on the 70B gate/up shape (M=1) and prints the fastest accurate one (stdout), the
table on stderr: `export STRATA_GEMV_IQ3S=$(python3 bench/pick_iq3s.py)` (the override of kernels.gemv_iq3s)."""
import sys
import torch
sys.path.insert(0, ".")
from strata.quant import dequantize, gemv, random_blocks
g = torch.Generator(device="cuda").manual_seed(0)
rows, cols = 57344, 8192
blocks = random_blocks("IQ3_S", rows, cols, g, device="cuda")
x = torch.randn(1, cols, generator=g, device="cuda").bfloat16()
want = x.double() @ dequantize(blocks, "IQ3_S").double().T
best = None
for mode in gemv.IQ3S_KERNELS:
    k = gemv.GemvKernels(iq3s=mode)  # each kernel's own: a failed dp4a one falls back on it, not on the next
    try:
        y = gemv.quant_matmul_parts(x, [(blocks, "IQ3_S")], cols, kernels=k)
    except Exception as e:  # noqa: BLE001
        print(f"{mode}: failed {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        continue
    err = float((y.double() - want).norm() / want.norm())
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        gemv.quant_matmul_parts(x, [(blocks, "IQ3_S")], cols, kernels=k)
    s.record()
    for _ in range(20):
        gemv.quant_matmul_parts(x, [(blocks, "IQ3_S")], cols, kernels=k)
    e.record(); torch.cuda.synchronize()
    us = s.elapsed_time(e) / 20 * 1e3
    gbs = blocks.numel() / us / 1e3
    ok = err < 2e-2 and k.iq3s == mode
    print(f"{mode:12s} {us:8.1f} us {gbs:7.0f} GB/s rel {err:.1e} {'ok' if ok else 'REJECTED'}", file=sys.stderr)
    if ok and (best is None or us < best[0]):
        best = (us, mode)
print(best[1] if best else "float")
