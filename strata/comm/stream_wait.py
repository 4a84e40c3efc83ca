"""A CUDA stream that waits for a word of page-locked host memory (the driver's cuStreamWaitValue32).

Decode's launch-ahead (workers/decode_ring.py) queues a stage's next step behind such a wait on the seq word of the
stage's doorbell (strata/comm/bells.py): when the hop above rings, the GPU starts the step by itself, with no host
step (take the note, copy in, launch) between the ring and the kernels. The comparison is the driver's cyclic
">=" on 32 bits, so the bells' 64-bit sequence numbers can be compared by their low word (little-endian).
"""
from __future__ import annotations

import ctypes

import torch

_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0
_lib = None
_fns: dict | None = None


def _driver() -> dict | None:
    """The driver entry points, or None where there is no libcuda (CPU machines)."""
    global _lib, _fns
    if _fns is None:
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            _fns = {}
            return None
        # the _v2 names are what cuda.h maps the plain ones to since CUDA 12; `works` tries one before use
        wait = getattr(_lib, "cuStreamWaitValue32_v2", None) or getattr(_lib, "cuStreamWaitValue32", None)
        devptr = getattr(_lib, "cuMemHostGetDevicePointer_v2", None)
        if wait is None or devptr is None:
            _fns = {}
            return None
        wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        wait.restype = ctypes.c_int
        devptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        devptr.restype = ctypes.c_int
        _fns = {"wait": wait, "devptr": devptr}
    return _fns or None


def device_address(host: torch.Tensor) -> int:
    """The device's address of a word in page-locked (cudaHostRegister'ed) host memory; the current device's
    context must be the one that registered it."""
    fns = _driver()
    if fns is None:
        raise RuntimeError("no CUDA driver (libcuda.so.1) with stream memory operations")
    out = ctypes.c_uint64(0)
    rc = fns["devptr"](ctypes.byref(out), ctypes.c_void_p(host.data_ptr()), 0)
    if rc != 0:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed (CUresult {rc}): is the memory page-locked?")
    return out.value


def wait_geq(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Queue on `stream`: wait until the 32-bit word at device `address` is >= value (cyclically)."""
    fns = _driver()
    if fns is None:
        raise RuntimeError("no CUDA driver (libcuda.so.1) with stream memory operations")
    rc = fns["wait"](ctypes.c_void_p(stream.cuda_stream), address, value & 0xFFFFFFFF, _GEQ)
    if rc != 0:
        raise RuntimeError(f"cuStreamWaitValue32 failed (CUresult {rc})")


def works(word: torch.Tensor, device: torch.device) -> str | None:
    """None when a stream on `device` can wait on this page-locked host word (a wait already satisfied, run
    once), else why not, in a few words."""
    if _driver() is None:
        return "no CUDA driver with stream memory operations"
    try:
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            wait_geq(stream, device_address(word), int(word.item()))
            stream.synchronize()
    except RuntimeError as e:
        return str(e)
    return None
