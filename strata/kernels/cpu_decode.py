"""CPU decode steps in C on 4/8-bit blocks (`decode_weights: blocks`): strata/kernels/csrc/cpu_decode.c, built once
per machine with the system's C compiler and loaded with ctypes (no torch headers: a build takes ~1 s).

The products read GGUF's own Q4_0 / Q4_1 / Q8_0 blocks as stored (the file's weights, bit for bit);
other matrices (K-quants, float files) are quantized to 8 bits per 32 here. The input row of each product is
quantized to 8 bits per 32, as llama.cpp does, so results differ from the dense float32 path by that rounding
(SmolLM2: logits within ~1e-2 of their range). Prefill keeps the dense weights; the KV cache is shared, so
decode continues whatever prefill wrote."""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from strata.config import cache_dir

SOURCE = Path(__file__).parent / "csrc" / "cpu_decode.c"
BLOCK = 32
ROWS = 16  # rows interleaved per group (one AVX-512 register of int32 lanes; two AVX2 ones)
BUILDS = {1: "AVX-512 VNNI", 2: "AVX2", 0: "portable"}  # strata_simd() -> the build's vector path
EXACT = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # GGUF types used as stored: bytes per block


class BuildError(RuntimeError):
    pass


class Mat(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p),
                ("bits", ctypes.c_int32), ("rows", ctypes.c_int32), ("cols", ctypes.c_int32), ("pad_", ctypes.c_int32)]


class Layer(ctypes.Structure):
    _fields_ = [(n, Mat) for n in ("wq", "wk", "wv", "wo", "wg", "wu", "wd")] + [
        (n, ctypes.c_void_p) for n in ("attn_norm", "mlp_norm", "bq", "bk", "bv", "k_cache", "v_cache")]


class Model(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("dim", "n_heads", "n_kv", "hd", "ffn", "max_len", "n_layers",
                                               "kv_bits")] + [
        ("eps", ctypes.c_float), ("pad_", ctypes.c_int32), ("layers", ctypes.POINTER(Layer)), ("work", ctypes.c_void_p)]


# -- the library -----------------------------------------------------------------------------------
_libs: dict[bool, ctypes.CDLL] = {}
_lock = threading.Lock()


KV_DTYPES = {torch.float32: 32, torch.bfloat16: 16, torch.float8_e4m3fn: 8}  # the caches the C attention reads
# what strata/kernels/csrc/cpu_decode.c implements beyond the Llama core (ModelArgs.extras), the one place its coverage is
# declared: nothing. The one layer body (strata.models.layer) runs every other variation; a model using one is refused here
# (`uncovered`), never decoded in C without it.
C_EXTRAS: frozenset[str] = frozenset()


def uncovered(args) -> list[str]:
    """The variations of `args` (ModelArgs.extras) the C decoder does not implement."""
    return [e for e in args.extras() if e not in C_EXTRAS]


def auto_kind(args, quantized: bool, weights: str, kv_dtype: torch.dtype = torch.float32) -> tuple[str, str]:
    """`decode_weights: auto` on a CPU stage -> ("blocks" or "none", why): the C decoder where it multiplies the
    file's own blocks (a quantized file, dequantized for the prefill, a Llama-core model, a C compiler found, a CPU
    with its vector path: AVX-512 VNNI or AVX2; SmolLM2 on 2 stages: 13.7 -> 112.5 tok/s), else the dense weights.
    A float model stays dense: blocks would round its weights to 8 bits, which is a choice the rig makes
    (`decode_weights: blocks`), not a default; so does a CPU with neither vector path, where the plain C build is
    slower than the dense weights (SmolLM2: ~250 ms a step against ~70-100)."""
    if not quantized:
        return "none", "float weights (blocks would round them to 8 bits)"
    if weights != "dequantized":
        return "none", f"weights {weights} (the C decoder reads a dequantized slice's blocks beside it)"
    if uncovered(args):
        return "none", f"the C decoder implements the Llama core; {args.arch} uses {', '.join(uncovered(args))}"
    if kv_dtype not in KV_DTYPES:
        name = "q8_0" if kv_dtype == torch.uint8 else str(kv_dtype).removeprefix("torch.")
        return "none", f"kv_dtype {name} (the C decoder reads a float32, bfloat16 or float8_e4m3fn cache)"
    try:
        lib = library()
    except BuildError as e:
        return "none", str(e)
    if not lib.strata_simd():
        return "none", ("this CPU has neither AVX-512 VNNI nor AVX2 + FMA + F16C: the C decoder's plain build "
                        "is slower than the dense weights (decode_weights: blocks takes it all the same)")
    return "blocks", "the file's blocks in C"


def library(portable: bool = False) -> ctypes.CDLL:
    """The compiled kernel, built on first use into this host's cache (strata.config.cache_dir) and
    reused while the source, compiler and flags are the same. portable: without -march=native (the plain C
    path; tests compare it with the vector one). Raises BuildError naming what is missing."""
    with _lock:
        if portable in _libs:
            return _libs[portable]
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if not cc or not shutil.which(cc):
            raise BuildError("decode_weights=blocks builds strata/kernels/csrc/cpu_decode.c and finds no C compiler "
                             "(set CC, or install gcc)")
        flags = ["-O2", "-std=c11", "-fPIC", "-shared"] + ([] if portable else ["-march=native"])
        try:
            version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as e:
            raise BuildError(f"{cc} --version failed: {e}") from None
        src = SOURCE.read_bytes()
        key = hashlib.sha256(src + " ".join([cc, version] + flags).encode()).hexdigest()[:16]
        out = cache_dir() / f"cpu_decode-{key}.so"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
            os.close(fd)
            r = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                               timeout=300)
            if r.returncode:
                os.unlink(tmp)
                first = (r.stderr.strip().splitlines() or ["?"])[0]
                raise BuildError(f"building {SOURCE.name} with {cc} failed: {first}")
            os.replace(tmp, out)  # atomic: stages building at once each install a whole file
        lib = ctypes.CDLL(str(out))
        lib.strata_simd.restype = ctypes.c_int
        lib.strata_to_e4m3.restype = ctypes.c_uint8
        lib.strata_to_e4m3.argtypes = [ctypes.c_float]
        lib.strata_work_floats.restype = ctypes.c_long
        lib.strata_work_floats.argtypes = [ctypes.POINTER(Model)]
        lib.strata_matvec.argtypes = [ctypes.POINTER(Mat)] + [ctypes.c_void_p] * 3
        lib.strata_attend.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.strata_layers.argtypes = [ctypes.POINTER(Model), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                      ctypes.c_void_p]
        lib.strata_head.restype = ctypes.c_int
        lib.strata_work_rows_floats.restype = ctypes.c_long
        lib.strata_work_rows_floats.argtypes = [ctypes.POINTER(Model), ctypes.c_int]
        lib.strata_layers_rows.argtypes = [ctypes.POINTER(Model), ctypes.c_int] + [ctypes.c_void_p] * 6
        lib.strata_head_rows.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.POINTER(Mat)] + [ctypes.c_void_p] * 3
        lib.strata_head.argtypes = [ctypes.POINTER(Model), ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(Mat),
                                    ctypes.c_void_p]
        _libs[portable] = lib
        return lib


# -- matrices in the kernel's layout -----------------------------------------------------------------
class Packed:
    """One matrix interleaved 16 rows at a time (see the C file's header): q (bytes), d and m (float16)."""

    def __init__(self, u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int, cols: int):
        """u: (rows, blocks, 16) GGUF qs bytes (4-bit) or (rows, blocks, 32) unsigned bytes (8-bit); d, m:
        (rows, blocks) float16, so that weight = d * u + m."""
        rows, J = d.shape
        G = -(-rows // ROWS)
        pad = G * ROWS - rows
        if pad:
            u = torch.cat([u, u.new_zeros(pad, *u.shape[1:])])
            d, m = torch.cat([d, d.new_zeros(pad, J)]), torch.cat([m, m.new_zeros(pad, J)])
        per = u.shape[2] // 4  # 4-byte groups a block: 4 (4-bit) or 8 (8-bit)
        self.q = u.view(G, ROWS, J, per, 4).permute(0, 2, 3, 1, 4).contiguous()
        self.d = d.view(G, ROWS, J).transpose(1, 2).contiguous().view(torch.int16)
        self.m = m.view(G, ROWS, J).transpose(1, 2).contiguous().view(torch.int16)
        self.rows, self.cols, self.bits = rows, cols, bits
        self.mat = Mat(self.q.data_ptr(), self.d.data_ptr(), self.m.data_ptr(), bits, rows, cols, 0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m))


def from_blocks(blocks: torch.Tensor, qtype: str, cols: int) -> Packed | None:
    """GGUF blocks (rows, bytes a row) of Q4_0 / Q4_1 / Q8_0 as the kernel reads them, the weights unchanged;
    None for other types (or a Q8_0 scale too large for m = -128 d in float16)."""
    size = EXACT.get(qtype)
    if size is None or cols % BLOCK:
        return None
    b = blocks.contiguous().view(blocks.shape[0], cols // BLOCK, size)
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0]
    if qtype == "Q4_1":
        return Packed(b[..., 4:20], d, b[..., 2:4].contiguous().view(torch.float16)[..., 0], 4, cols)
    if qtype == "Q4_0":
        return Packed(b[..., 2:18], d, (d.float() * -8).half(), 4, cols)  # a power of two: exact
    m = (d.float() * -128).half()
    if not torch.isfinite(m).all():
        return None
    u = (b[..., 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return Packed(u, d, m, 8, cols)


def from_dense(w: torch.Tensor) -> Packed:
    """A float matrix quantized to 8 bits per 32 (GGUF Q8_0's rule: d = max |w| / 127, rounded to float16)."""
    rows, cols = w.shape
    g = w.detach().float().reshape(rows, cols // BLOCK, BLOCK)
    d = (g.abs().amax(-1) / 127).half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros(()))
    q = torch.round(g * inv[..., None]).clamp(-127, 127)
    return Packed((q + 128).to(torch.uint8), d, (d.float() * -128).half(), 8, cols)


def matvec(p: Packed, x: torch.Tensor, portable: bool = False) -> torch.Tensor:
    """p's product with one row x (cols,) float32 -> (rows,) float32: the kernel alone (tests, benchmarks)."""
    lib = library(portable)
    x = x.detach().float().contiguous()
    y = torch.empty(p.rows, dtype=torch.float32)
    work = torch.empty(p.cols, dtype=torch.float32)
    lib.strata_matvec(ctypes.byref(p.mat), x.data_ptr(), y.data_ptr(), work.data_ptr())
    return y


# -- a stage's decode step ---------------------------------------------------------------------------
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, portable: bool = False) -> torch.Tensor:
    """One kv head's decode attention as a step computes it (tests): q (G, hd) float32 against cached rows
    k, v (L, hd) float32, bfloat16 or float8_e4m3fn -> (G, hd) float32."""
    if q.dtype != torch.float32 or k.dtype not in KV_DTYPES or v.dtype != k.dtype:
        raise ValueError("attend takes float32 q and a float32, bfloat16 or float8_e4m3fn cache")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    (g, hd), n = q.shape, k.shape[0]
    out = torch.empty(g, hd)
    sc = torch.empty(g * n)
    library(portable).strata_attend(q.data_ptr(), g, k.data_ptr(), v.data_ptr(), 8 * k.element_size(), n, hd,
                                    sc.data_ptr(), out.data_ptr())
    return out


def supported(model) -> str | None:
    """Why `model` (a strata.models.model.Transformer slice) cannot decode here, or None."""
    a = model.args
    if uncovered(a):
        return f"implements the Llama core only (this model also has: {', '.join(uncovered(a))})"
    device, dtype = model.device_dtype()
    if device.type != "cpu" or dtype != torch.float32:
        return f"needs float32 weights on the CPU (this slice: {dtype} on {device})"
    if a.dim % BLOCK or a.ffn_dim % BLOCK or (a.n_heads * a.head_dim) % BLOCK:
        return f"needs widths in whole {BLOCK}-blocks (dim {a.dim}, ffn {a.ffn_dim}, heads x hd {a.n_heads * a.head_dim})"
    if a.head_dim % 2 or a.head_dim > 256:
        return f"needs an even head_dim up to 256 (got {a.head_dim})"
    return None


class Decoder:
    """A Transformer slice's layers (and head, on the last slice) packed for strata_layers / strata_head.

    stored: canonical name -> strata.models.model.Quantized, the slice's GGUF blocks where the file has them."""

    def __init__(self, model, stored: dict | None = None):
        why = supported(model)
        if why:
            raise ValueError(f"decode_weights=blocks {why}")
        self.lib = library()
        a, stored = model.args, stored or {}
        self.model, self.exact, self.requantized = model, 0, 0
        self._keep: list = []
        layers = []
        for i, blk in model.layers.items():
            w = blk.weights.get()
            mats = []
            # each group packed before the next is read: a resident layer's groups share one scratch (LazyMats)
            qkv = [a.n_heads * a.head_dim] + [a.n_kv_heads * a.head_dim] * 2
            for group, names, rows in (("wqkv", ("wq", "wk", "wv"), qkv), ("wo", ("wo",), None),
                                       ("w13", ("w_gate", "w_up"), [a.ffn_dim] * 2), ("w2", ("w_down",), None)):
                t = getattr(w, group)
                parts = t.split(rows) if rows else (t,)
                mats += [self._pack(stored.get(f"layers.{i}.{n}"), m) for n, m in zip(names, parts)]
            biases = (None, None, None)
            if w.bqkv is not None:
                bias = [t.contiguous() for t in w.bqkv.float().split(
                    [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim])]
                self._keep += bias
                biases = tuple(t.data_ptr() for t in bias)
            layers.append(Layer(*(p.mat for p in mats), blk.attn_norm.weight.data_ptr(), blk.mlp_norm.weight.data_ptr(),
                                *biases, None, None))
            self._keep += mats
        self._layers = (Layer * len(layers))(*layers)
        self.spec = Model(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.ffn_dim, 0, len(layers), 32, a.norm_eps, 0,
                          self._layers, None)
        self.head = None
        if model.has_head:
            self.head = self._pack(stored.get("head", stored.get("embed") if a.tie_embeddings else None),
                                   model.head.weight)
            self._keep.append(self.head)
        self.bind_cache()

    def bind_cache(self) -> None:
        """Point the layers at the model's KV cache (again after Transformer.setup_cache replaced it)."""
        max_len, bits = self.point_cache()
        self.spec.max_len, self.spec.kv_bits = max_len, bits
        self.work = torch.empty(self.lib.strata_work_floats(ctypes.byref(self.spec)), dtype=torch.float32)
        self.spec.work = self.work.data_ptr()
        self._slot_ptrs = self.slot_caches()
        self._rows_work = torch.empty(0, dtype=torch.float32)  # layers_rows' scratch, grown to the largest batch

    def slot_caches(self) -> list[torch.Tensor]:
        """Per slot (Transformer.setup_cache's seqs), its layers' K and V addresses in layer order: what a batch
        of several sequences' steps (`layers_rows`) reads and writes, row by row."""
        slots = self.model._slots
        if not slots:  # caches set by hand: the one in use
            slots = [{i: (blk.attn.k_cache, blk.attn.v_cache) for i, blk in self.model.layers.items()}]
        return [self._slot_ptr(slot) for slot in slots]

    def _slot_ptr(self, slot: dict) -> torch.Tensor:
        return torch.tensor([c.data_ptr() for i in self.model.layers for c in slot[i]], dtype=torch.int64)

    def slot_moved(self, slot: int) -> None:
        """Slot `slot` holds another extent of the KV pool (Transformer.place_slot): its addresses anew."""
        self._slot_ptrs[slot] = self._slot_ptr(self.model._slots[slot])

    def point_cache(self) -> tuple[int, int]:
        """The layers' cache pointers at the model's current slot (Transformer.use_slot) -> (the rows between one
        KV head's and the next's, bits). A slot of a KV pool is a view whose heads lie the pool's positions apart;
        its own positions (`cap`) bound the steps."""
        max_len, bits, self.cap = 0, 32, None
        for layer, blk in zip(self._layers, self.model.layers.values()):
            kc, vc = blk.attn.k_cache, blk.attn.v_cache
            if kc is None:
                raise RuntimeError("KV cache not allocated: call Transformer.setup_cache(max_len) first")
            hd = kc.shape[3]
            if kc.dtype not in KV_DTYPES or kc.stride() != vc.stride() or kc.stride()[2:] != (hd, 1):
                raise ValueError(f"decode_weights=blocks reads a float32, bfloat16 or float8_e4m3fn KV cache of "
                                 f"contiguous rows, not {kc.dtype} of strides {kc.stride()}")
            rows = kc.stride(1) // hd
            if max_len and rows != max_len:
                raise ValueError(f"decode_weights=blocks reads every layer's KV heads {max_len} rows apart, not {rows}")
            layer.k_cache, layer.v_cache = kc.data_ptr(), vc.data_ptr()
            max_len, bits = rows, KV_DTYPES[kc.dtype]
            self.cap = kc.shape[2] if self.cap is None else min(self.cap, kc.shape[2])
        return max_len, bits

    def _pack(self, q, dense: torch.Tensor) -> Packed:
        p = from_blocks(q.blocks, q.qtype, q.cols) if q is not None else None
        if p is None:
            p = from_dense(dense)
            self.requantized += 1
        else:
            self.exact += 1
        return p

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._keep if isinstance(p, Packed))

    def layers(self, h: torch.Tensor, pos: int, cos: torch.Tensor, ssin: torch.Tensor) -> None:
        """The slice's layers on one residual row h (dim,) float32 contiguous, in place; cos, ssin: (hd,) rows."""
        if pos >= self.cap:
            raise ValueError(f"position {pos} exceeds the KV cache ({self.cap})")
        self.lib.strata_layers(ctypes.byref(self.spec), h.data_ptr(), pos, cos.data_ptr(), ssin.data_ptr())

    def logits(self, h: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Final norm and head of one residual row h (dim,) -> (float32 logits (vocab,), first argmax)."""
        h = h.detach().float().contiguous()
        out = torch.empty(self.head.rows, dtype=torch.float32)
        best = self.lib.strata_head(ctypes.byref(self.spec), h.data_ptr(), self.model.norm.weight.data_ptr(),
                                    ctypes.byref(self.head.mat), out.data_ptr())
        return out, best

    # -- several sequences' steps at once (max_seqs > 1) -------------------------------------------------
    def _work_rows(self, m: int) -> torch.Tensor:
        need = self.lib.strata_work_rows_floats(ctypes.byref(self.spec), m)
        if self._rows_work.numel() < need:
            self._rows_work = torch.empty(need, dtype=torch.float32)
        return self._rows_work

    def layers_rows(self, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor,
                    slots: list[int]) -> None:
        """The slice's layers on m rows h (m, dim) float32 contiguous, in place: row t is sequence slots[t]'s
        token at positions[t] (int32 (m,)), with its RoPE rows cos[t], ssin[t] ((m, hd) contiguous). Each row's
        bits are those `layers` gives it alone: the products read the weights once for all the rows."""
        m = h.shape[0]
        for s, p in zip(slots, positions.tolist()):
            if p >= self.model.slot_positions(s):
                raise ValueError(f"position {p} exceeds slot {s}'s KV cache ({self.model.slot_positions(s)})")
        caches = torch.stack([self._slot_ptrs[s] for s in slots])
        self.lib.strata_layers_rows(ctypes.byref(self.spec), m, h.data_ptr(), positions.data_ptr(), cos.data_ptr(),
                                    ssin.data_ptr(), caches.data_ptr(), self._work_rows(m).data_ptr())

    def logits_rows(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Final norm and head of m rows h (m, dim) -> (float32 logits (m, vocab), each row's first argmax (m,))."""
        h = h.detach().float().contiguous()
        m = h.shape[0]
        out = torch.empty(m, self.head.rows, dtype=torch.float32)
        best = torch.empty(m, dtype=torch.int32)
        self.lib.strata_head_rows(ctypes.byref(self.spec), m, h.data_ptr(), self.model.norm.weight.data_ptr(),
                                  ctypes.byref(self.head.mat), out.data_ptr(), best.data_ptr(),
                                  self._work_rows(m).data_ptr())
        return out, best
