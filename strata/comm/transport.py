"""One boundary's hand-off: the rows of a chunk from a stage to the stage below (or the last row's
logits from the last stage to the head).

Both ends on this host: the rows sit in a /dev/shm segment both have mapped (`ShmLink`) and only
the note travels. Ends on different hosts: the rows travel with the note, as a second ZeroMQ frame
over tcp (`TcpLink`), sent zero-copy from the sender's hand-off buffer and written on arrival into
the receiver's own input buffer. The notes are the same messages either way, and so is the
one-buffer rule: a sender overwrites its buffer only after the chunk before has been "taken".
"""
from __future__ import annotations

import torch

from strata.comm import messages as M

SEND_RELEASE_S = 60.0  # ZeroMQ lets go of a sent frame long before "taken" comes back; this is a backstop


class ShmLink:
    """Rows in a shared segment (`buf`, mapped by both ends); `sock` carries the note."""

    crosses_hosts = False

    def __init__(self, buf: torch.Tensor, sock=None):
        self.buf, self.sock = buf, sock

    def put(self, rows: torch.Tensor, note: M.Message) -> None:
        """Sender: copy the rows into the shared buffer, then say so."""
        self.fill(rows)
        self.send(note)

    def fill(self, rows: torch.Tensor, non_blocking: bool = False) -> None:
        """The rows into the shared buffer. non_blocking (a CUDA source, the buffer page-locked): the copy is
        only queued on the current stream; the caller synchronizes it before `send`."""
        self.buf[:rows.shape[0]].copy_(rows, non_blocking=non_blocking)

    def send(self, note: M.Message) -> None:
        """The note for rows already in the buffer."""
        self.sock.send(M.encode(note))

    def get(self, n: int) -> torch.Tensor:
        """Receiver: the first n rows of the shared buffer."""
        return self.buf[:n]


class TcpLink:
    """Rows in a buffer of this process (`buf`, page-locked for a CUDA stage); they leave with the note
    as a second frame, and land in the receiver's own `TcpLink` buffer when the note arrives."""

    crosses_hosts = True

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], sock=None, pin: bool = False):
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.buf = self.raw.view(dtype).view(shape)
        self.row_bytes = nbytes // shape[0]
        self.bytes = memoryview(self.raw.numpy())  # what ZeroMQ reads from and what arrivals are copied into
        self.sock = sock
        self.tracker = None
        self.n = 0  # rows in the buffer (`fill`)

    def put(self, rows: torch.Tensor, note: M.Message) -> None:
        """Sender: copy the rows into the hand-off buffer and send note + rows; ZeroMQ reads the rows
        straight from the buffer (copy=False), tracked so the buffer is not rewritten under it."""
        self.fill(rows)
        self.send(note)

    def fill(self, rows: torch.Tensor, non_blocking: bool = False) -> None:
        """The rows into the hand-off buffer (once ZeroMQ has let go of the last ones); non_blocking as ShmLink."""
        if self.tracker is not None and not self.tracker.done:
            self.tracker.wait(SEND_RELEASE_S)  # raises zmq.NotDone past the backstop
        self.n = rows.shape[0]
        self.buf[:self.n].copy_(rows, non_blocking=non_blocking)

    def send(self, note: M.Message) -> None:
        """The note with the rows `fill` put in the buffer, sent zero-copy and tracked."""
        self.tracker = self.sock.send_multipart([M.encode(note), self.bytes[: self.n * self.row_bytes]],
                                                copy=False, track=True)

    def land(self, n: int, frame) -> None:
        """Receiver: the rows that came with the note for n rows, into the input buffer."""
        data = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        if data.nbytes != n * self.row_bytes:
            raise M.BadMessage(f"data frame of {data.nbytes} bytes for {n} rows of {self.row_bytes}")
        self.bytes[: data.nbytes] = data.cast("B")

    def get(self, n: int) -> torch.Tensor:
        return self.buf[:n]
