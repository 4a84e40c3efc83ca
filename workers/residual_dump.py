"""The last stage's residual rows after the last layer, written to residual.npy off the chunk's path."""
from __future__ import annotations

import threading

import numpy as np
import torch


class ResidualDump:
    """Residual rows after the last layer -> residual.npy (float32, exact for every dtype), off the chunk's path:
    on CUDA the rows are widened on the device and copied to a page-locked staging buffer on a stream of their
    own, and a thread waits for that copy and writes the file, while the next chunk computes."""

    def __init__(self, path: str, tokens: int, dim: int, max_chunk: int, device):
        self.file = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(tokens, dim))
        cuda = device.type == "cuda"
        self.staging = torch.empty((max_chunk, dim), dtype=torch.float32, pin_memory=cuda)
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.writer: threading.Thread | None = None
        self.rows = None  # the widened rows of a copy in flight (held until it is done)

    def write(self, pos: int, h) -> None:
        self.wait()  # the staging buffer is free again
        n = h.shape[0]
        rows = self.staging[:n]
        if self.stream is None:
            rows.copy_(h)
            done = None
        else:
            # widen on the device (a widening copy runs on one CPU core: ~0.1 s for 10,240 x 4,096), after the
            # chunk's kernels, then the copy out on the dump's own stream: the stage syncs only its own stream
            self.rows = h.float()
            self.stream.wait_stream(torch.cuda.current_stream(h.device))
            with torch.cuda.stream(self.stream):
                rows.copy_(self.rows, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
        self.writer = threading.Thread(target=self._write, args=(pos, rows.numpy(), done), daemon=True)
        self.writer.start()

    def _write(self, pos: int, rows: np.ndarray, done) -> None:
        if done is not None:
            done.synchronize()
        self.file[pos:pos + rows.shape[0]] = rows

    def wait(self) -> None:
        # no flush (msync) per chunk: it wrote each chunk's rows to disk inside the timed chunk (~0.15 s for
        # 10,240 x 4,096 on the GPU machine); the head reads the file through the same page cache
        if self.writer is not None:
            self.writer.join()
            self.writer = None
            self.rows = None
