"""The head's stage processes and everything a run must release: spawn, teardown, shared buffers, ipc dir.

`Resources` is kept apart from the Pipeline so that its `weakref.finalize` holds no cycle: whatever
way a run ends (return, exception, Ctrl-C, garbage collection), `release` stops the stages (ask,
wait, terminate, kill), closes the sockets, ends the context and unlinks the buffers.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from strata.errors import PipelineError

PAGE = 4096
IPC_PREFIX = "strata-ipc-"          # + head pid + "-": a later start removes the dirs of dead heads


def sweep_dead_ipc_dirs() -> list[str]:
    """Remove per-run ipc directories left by heads that died without cleaning up (SIGKILL)."""
    removed = []
    base = Path(tempfile.gettempdir())
    pat = re.compile(rf"^{IPC_PREFIX}(\d+)-")
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for d in entries:
        m = pat.match(d.name)
        if not m:
            continue
        try:
            if d.stat().st_uid != os.getuid() or not d.is_dir():
                continue
            os.kill(int(m[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
        except OSError:
            continue
    return removed


def _page(n: int) -> int:
    return max(PAGE, (n + PAGE - 1) // PAGE * PAGE)


class Resources:
    """Everything that must be released: processes, pipes, sockets, the context, segments, the ipc dir."""

    def __init__(self):
        self.procs: list = []
        self.conns: list = []
        self.segments: list = []
        self.socks: list = []
        self.ctx = None
        self.ipc_dir: str | None = None
        self.net = None            # strata.head.net.HeadNet when a stage is remote

    def release(self, grace_s: float = 5.0) -> None:
        # ask (stop message, sent by the caller), wait, terminate, kill
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for c in self.conns:
            c.close()
        for s in self.socks:
            if not s.closed:
                s.close(linger=0)
        if self.net is not None:
            self.net.stop()  # its thread, its sockets, the ZAP handler: before the context ends
            self.net = None
        if self.ctx is not None:
            self.ctx.term()
        for seg in self.segments:
            seg.unlink()
            seg.close()
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        self.procs, self.conns, self.segments, self.socks, self.ctx, self.ipc_dir = [], [], [], [], None, None

    def make_ipc_dir(self) -> str:
        # mode 0700: only this user reaches the sockets (messages are validated, not authenticated)
        self.ipc_dir = tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")
        return self.ipc_dir


class Buffers:
    """The run's shared segments: token ids, the last stage's logits row, one hand-off buffer per boundary
    inside this host (a boundary across hosts has none: its rows travel with the note), and the decode
    doorbells when they are on (strata/comm/bells.py)."""

    def __init__(self, res: Resources, run_id: str, plan, remote: list[bool], across: list[bool]):
        import torch  # here, not at the top: the launcher imports this module before torch (start_forkserver)

        from strata.comm import shm
        shm.sweep_dead()
        seqs = plan.cfg.max_seqs  # a sequence's ids at slot x (max_len + 1)
        sizes = {"ids": _page(seqs * (plan.max_len + 1) * 4), "result": _page(seqs * plan.args.vocab_size * 4)}
        if remote[-1]:
            del sizes["result"]  # the last stage's logits come over tcp
        from strata.comm import bells
        if plan.resolved.decode_bells:  # the rig's kernels.decode_bells, as the plan resolved it
            sizes["bells"] = _page(bells.nbytes(len(remote)))  # decode steps' notes (strata/comm/bells.py)
        for i in range(len(remote) - 1):
            if not across[i]:
                sizes[f"b{i}"] = _page(plan.handoff_bytes())
        try:
            shm.check_room(sum(sizes.values()))
        except OSError as e:
            raise PipelineError(str(e)) from None
        self.names: dict[str, tuple[str, int]] = {}  # what -> (segment name, bytes): the stages attach these
        for what, nbytes in sizes.items():
            seg = shm.Segment.create(shm.segment_name(run_id, what), nbytes)
            res.segments.append(seg)
            self.names[what] = (seg.name, nbytes)
        self.ids = res.segments[0].tensor(torch.int32, (seqs * (plan.max_len + 1),))
        # logits rows: a chunk's last row in row 0; a decode batch's row t in row t (max_seqs rows)
        self.result = None if remote[-1] else res.segments[1].tensor(torch.float32, (seqs, plan.args.vocab_size))
        self.bells = None
        if "bells" in sizes:
            seg = res.segments[list(sizes).index("bells")]
            self.bells = bells.Bells(seg.tensor(torch.int64, (len(remote) + 1, bells.ROW)).numpy())


# What a forked stage would otherwise import itself (~1.5 s of CPU per stage): torch, the stage code, the GGUF
# reader and dequantizers. Not torch._dynamo (with sympy, ~1 s): the model is built on the meta device without
# the random inits and the meta arange that would import it (strata/models/model.py `_Linear`, `rope_frequencies`)
PRELOAD = ["torch", "workers.bootstrap", "strata.weights.gguf_loader", "strata.quant",
           "strata.head.forkserver_exit"]  # the last: its socket directory goes with it, however the head ends
_forkserver = {"started": False}


def no_gpu_devices() -> bool:
    """No NVIDIA / AMD device nodes: torch would see no GPU (asked without importing torch)."""
    import glob
    return not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"))


def start_forkserver() -> None:
    """Start multiprocessing's fork server now, importing PRELOAD in the background, so that CPU stages
    started later are forks of a process that has imported them already. The server is a fresh
    interpreter (not a fork of the head) that never touches CUDA, and only CPU stages are forked from it."""
    if _forkserver["started"]:
        return
    from multiprocessing import forkserver
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()  # returns at once; the server imports PRELOAD before its first fork
    _forkserver["started"] = True


def stop_forkserver(grace_s: float = 2.0) -> None:
    """End multiprocessing's helpers, the fork server (with any stage still forked from it) and the resource
    tracker, and reap them: the launcher, on its way out, once every stage has exited. A head that exits first
    leaves them running for a second or two (the fork server imports or tears down torch), and a supervisor
    sees those as leftovers; one still importing PRELOAD would also outlive a refused run by seconds."""
    import signal
    from multiprocessing import forkserver, resource_tracker

    from strata.head.leftovers import Proc, descendants, wait_gone
    fs = forkserver._forkserver
    pid = getattr(fs, "_forkserver_pid", None) if _forkserver["started"] else None
    if pid:
        forked = [Proc(c) for c in descendants(pid)]  # stages a failed start left behind: they die with it (PDEATHSIG)
        try:
            os.kill(pid, signal.SIGKILL)  # closing its pipe alone would wait for its imports to finish
        except ProcessLookupError:
            pass
        try:
            fs._stop()  # reaps it, removes its socket
        except (AttributeError, OSError):
            pass
        for p in wait_gone(forked, grace_s):
            os.kill(p.pid, signal.SIGKILL)
    _forkserver["started"] = False
    # the tracker exits when its pipe closes; it holds nothing of ours (strata.comm.shm tracks its own segments)
    rt = resource_tracker._resource_tracker
    rpid, fd = getattr(rt, "_pid", None), getattr(rt, "_fd", None)
    if rpid is None or fd is None:
        return
    tracker = Proc(rpid)
    os.close(fd)
    rt._fd = rt._pid = None
    if wait_gone([tracker], grace_s):
        os.kill(rpid, signal.SIGKILL)
    os.waitpid(rpid, 0)


def start_method(device: str) -> str:
    """How a local stage on `device` is started: 'forkserver' (a CPU stage once the fork server runs) or 'spawn'."""
    return "forkserver" if _forkserver["started"] and device == "cpu" else "spawn"


def spawn_local(res: Resources, spec, index: int) -> int:
    """Start stage `index` as a child process; its pid. CUDA stages (and any stage when no fork server
    was started) are spawned: CUDA cannot survive a fork. A CPU stage is forked from the fork server
    when `start_forkserver` ran. The pipe is its lifeline: EOF on the child's end means the head is gone."""
    from workers.bootstrap import run_stage_process
    ctx = mp.get_context(start_method(spec.device))
    parent_end, child_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_stage_process, args=(spec, parent_end), name=f"strata-stage-{index}", daemon=True)
    proc.start()
    parent_end.close()
    res.procs.append(proc)
    res.conns.append(child_end)
    return proc.pid
