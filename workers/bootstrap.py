"""A stage process's life around the Stage: lifelines to the head, logging, the typed failure report,
the exit. `run_stage_process` is the entry point the head spawns (and a joined remote stage calls).
"""
from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import traceback

import zmq

from strata.comm import messages as M

from workers.sockets import head_push
from workers.stage import Stage


def _die_with_parent() -> None:
    """Backstop for orphaning: the kernel sends SIGKILL when the head dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def _watch_head(conn, log_fd: int | None = None) -> None:
    """The pipe's EOF means the head is gone: exit at once, whatever the main thread is doing."""
    def watch():
        try:
            conn.recv_bytes()
        except (EOFError, OSError):
            pass
        if log_fd is not None:  # a raw write: no logging lock the main thread might hold
            try:
                os.write(log_fd, f"head gone (pipe EOF): stage pid {os.getpid()} exits\n".encode())
            except OSError:
                pass
        os._exit(3)
    threading.Thread(target=watch, name="head-watch", daemon=True).start()


def _flush_sockets(timeout_s: float) -> None:
    """Terminate ZeroMQ so queued messages (the typed failure) leave before os._exit kills its I/O
    thread. Bounded: term() waits for every socket, and a failed __init__ may have left one open."""
    t = threading.Thread(target=zmq.Context.instance().term, daemon=True)
    t.start()
    t.join(timeout_s)


def run_stage_process(spec: M.StageJob, head_conn, joined: dict | None = None) -> None:
    """Entry point of a stage process (spawned by the head; or, with `joined`, a remote stage that has
    joined: `main`). A remote stage logs to stderr (the head keeps it as stage-N.log) and notices a
    dead head by its heartbeats instead of a pipe."""
    local = head_conn is not None
    if local:
        _die_with_parent()
    log_stream = open(spec.log_file, "a") if local else sys.stderr
    if local:
        _watch_head(head_conn, log_stream.fileno())
    i = spec.index
    log = logging.getLogger(f"stage{i}")
    log.setLevel(logging.INFO)
    fmt = logging.Formatter(f"%(asctime)s [stage {i}] %(levelname)s %(message)s")
    fh = logging.FileHandler(spec.log_file) if local else logging.StreamHandler(sys.stderr)
    fh.setFormatter(fmt)
    log.addHandler(fh)
    if spec.console and local:
        ch = logging.StreamHandler(sys.stderr)
        ch.setFormatter(logging.Formatter(f"[stage {i}] %(message)s"))
        ch.setLevel(logging.WARNING)
        log.addHandler(ch)
    faulthandler.enable(file=log_stream)
    faulthandler.register(signal.SIGUSR1, file=log_stream, all_threads=True)  # the watchdog's stack dump
    if local:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the head's to handle; it tells us to stop
    joined = joined or {}
    stage, code = None, 0
    try:
        log.info("pid %d, device %s, layers [%d, %d)", os.getpid(), spec.device, spec.start, spec.end)
        if not local:
            log.info("joined the head from %s: %s, tcp in %s, tcp out %s", socket.gethostname(), spec.net.host,
                     spec.net.tcp_in, spec.net.tcp_out)
        stage = Stage(spec, log, ids=joined.get("ids"), clock_offset=joined.get("clock_offset", 0.0))
        log.info("ready: loaded in %.2fs (kernel warm-up %.2fs), KV cache %d bytes, pinned=%s", stage.load_s,
                 stage.warm_s, stage.kv_bytes, stage.pinned)
        stage.serve()
    except SystemExit:
        log.info("stopping (%d bad frames rejected)", stage.bad_frames if stage else 0)
    except BaseException as e:  # noqa: BLE001 - report every failure upward, typed, then exit
        tb = traceback.format_exc()
        log.error("failed: %s", tb)
        _report_failure(spec, stage, e, tb)
        code = 1
    if stage is not None:
        stage.close(linger_ms=2000 if code else 0)
    if joined.get("watch") is not None:
        joined["watch"].stop()
    if code:
        _flush_sockets(3.0)  # the "fail" must reach the head before the exit code does
    logging.shutdown()
    log_stream.flush()
    os._exit(code)


def _report_failure(spec, stage, exc, tb) -> None:
    try:
        frame = M.encode(M.Fail(stage=spec.index, pid=os.getpid(), device=spec.device,
                                chunk=stage.current_chunk if stage else -1, error=type(exc).__name__,
                                message=str(exc)[:2000], traceback=tb[-8000:]))
        if stage is not None:
            stage.to_head.send(frame)
        else:
            s = head_push(zmq.Context.instance(), spec)
            s.send(frame)
            s.close()
    except Exception:  # noqa: BLE001 - the head still sees the exit code
        pass
