"""A stage's shared memory: the prompt's ids, its hand-off links above and below, the decode doorbells."""
from __future__ import annotations

import torch

from strata.comm import bells as bells_mod
from strata.comm import messages as M
from strata.models.args import ModelArgs
from strata.comm.bells import Bells
from strata.comm.shm import Segment
from strata.comm.transport import ShmLink, TcpLink


class StageBuffers:
    """What a stage maps: the ids (all stages read them), the input boundary, the output boundary (or, on the
    last stage, the result row) and the bells. A boundary inside this host is a shared segment (`ShmLink`); one
    that crosses hosts is a buffer of this process whose rows travel with the note over tcp (`TcpLink`).
    `ids`: a remote stage's prompt ids (they came with its spec): it has no ids segment."""

    def __init__(self, spec: M.StageJob, args: ModelArgs, ids: bytes | None):
        device, dtype = torch.device(spec.device), getattr(torch, spec.dtype)
        i, first, last = spec.index, spec.index == 0, spec.index == spec.n_stages - 1
        net = spec.net
        tcp_in, tcp_out = bool(net and net.tcp_in), bool(net and net.tcp_out)
        segs = spec.segments
        self.segments: list[Segment] = []

        def attach(key):
            name, nbytes = segs[key]
            seg = Segment.attach(name, nbytes)
            self.segments.append(seg)
            return seg

        # decode doorbells (strata/comm/bells.py): every stage local and on a GPU (or forced for tests)
        self.bell_words = (attach("bells").tensor(torch.int64, (spec.n_stages + 1, bells_mod.ROW))
                           if "bells" in segs else None)
        self.bells = Bells(self.bell_words.numpy()) if self.bell_words is not None else None
        if ids is None:
            self.ids = attach("ids").tensor(torch.int32, (spec.max_seqs * (spec.max_len + 1),))
        else:  # decoded tokens reach a remote stage 0 as "token" notes
            self.ids = torch.zeros(spec.max_len + 1, dtype=torch.int32)
            self.ids[:spec.tokens] = torch.frombuffer(bytearray(ids), dtype=torch.int32)
        dim, cmax = args.dim, spec.max_chunk
        pin = device.type == "cuda"
        self.inlink = None
        if not first:
            self.inlink = (TcpLink(dtype, (cmax, dim), pin=pin) if tcp_in
                           else ShmLink(attach(f"b{i - 1}").tensor(dtype, (cmax, dim))))
        if last:
            self.outlink = (TcpLink(torch.float32, (args.vocab_size,), pin=pin) if tcp_out
                            else ShmLink(attach("result").tensor(torch.float32, (spec.max_seqs * args.vocab_size,))))
        else:
            self.outlink = (TcpLink(dtype, (cmax, dim), pin=pin) if tcp_out
                            else ShmLink(attach(f"b{i}").tensor(dtype, (cmax, dim))))
        self.pinned = False  # page-locked for the GPU's copies (the ids are read on the host)
        if device.type == "cuda":
            self.pinned = all(s.pin() for s in self.segments if s.name.split("-")[-1] != "ids")
        # the last stage's decode argmax, copied out with the step's other output
        self.argmax_host = torch.empty((), dtype=torch.long, pin_memory=device.type == "cuda")

    def close(self) -> None:
        for seg in self.segments:
            seg.close()
