"""The wire under fire: random and garbled frames at the stages' and the head's sockets.

Every frame that is not a well-formed message of a type the receiver takes (with values that fit
the run: phases, chunk indices, rows inside the buffers, stage indices) is rejected, counted and
logged; the run still succeeds with exactly the result of a clean run, and the counts are in the
report. A well-formed message of an accepted type *is* acted on by design: the wire is validated,
not authenticated. Who may send is settled by the endpoints living in a per-run 0700 directory.
"""
from __future__ import annotations

import random
import time

import msgpack
import pytest
import zmq

from conftest import make_rig

from strata.comm import messages as M

STAGE_TAKES = ("chunk", "taken", "done", "end", "stop")
PHASES = ("prefill", "decode")
KINDS = ("chunk", "step", "batch", "group")


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _valid(t: str) -> dict:
    """A well-formed message of type t with plausible values (built from the schema, so it keeps up)."""
    named = {"phase": "prefill", "kind": "chunk",
             "k": 1, "pos": 0, "n": 16, "stage": 0, "device": "cpu", "chunk": 1, "op": "drop",
             "ahead": 0}  # (a chunk runs steps ahead only as a decode batch)
    by_type = {bool: False, int: 1, float: 0.5, str: "x", list: [], bytes: b""}

    def value(f, kinds):
        if f in named:
            return named[f]
        return next(by_type[k] for k in (bool, int, float, str, list, bytes) if k in kinds)
    return {"v": M.VERSION, "t": t, **{f: value(f, kinds) for f, kinds in M.SCHEMA[t].items()}}


_JUNK = [None, True, 0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 3.25, float("nan"), "", "chunk", "x" * 5000, b"",
         b"\x00\xff" * 50, [], [1, [2, [3]]], {}, {"a": {"b": [None]}}, msgpack.ExtType(5, b"abc")]


def _random_bytes(r):
    return r.randbytes(r.choice([0, 1, 2, 7, 40, 300, 4096]))


def _wrong_shape(r):
    return _pack(r.choice(_JUNK + [[_valid("stop")], [_valid("chunk")], ("v", 1, "t", "stop")]))


def _wrong_version(r):
    m = _valid(r.choice(STAGE_TAKES))
    m["v"] = r.choice([0, 2, -1, "1", 1.0, True, None, 2**32, [1], {"v": 1}])
    return _pack(m)


def _unknown_type(r):
    m = _valid("chunk")
    m["t"] = r.choice(["", "chunkk", "STOP", "Chunk", 5, None, b"chunk", ["chunk"], "x" * 1000, True])
    return _pack(m)


def _huge_ints(r):
    m = _valid(r.choice(("chunk", "taken", "done")))
    f = r.choice([f for f in ("k", "pos", "n") if f in m])
    m[f] = r.choice([2**63, 2**64 - 1, 2**64 - 2**32])
    return _pack(m)


def _nested_junk(r):
    kind = r.randrange(4)
    if kind == 0:  # deep nesting: a list of lists of ... (msgpack's own stack limit or not a map)
        depth = r.choice([10, 500, 1100, 5000])
        return b"\x91" * depth + b"\xc0"
    if kind == 1:  # a map with non-string keys (strict_map_key refuses them)
        return b"\x82\x01\x02\xc3\xc2"
    if kind == 2:  # a field holding nested junk
        m = _valid("chunk")
        m[r.choice(["k", "pos", "n", "kind"])] = {"a": [[[{"b": None}]]]}
        return _pack(m)
    # an array header that claims far more elements than the frame holds
    return b"\xdd\xff\xff\xff\xff" + r.randbytes(16)


def _bad_field_types(r):
    m = _valid("chunk")
    f = r.choice(["k", "pos", "n", "kind"])
    m[f] = r.choice(["3", 1.5, None, True, False, b"prefill", [1], {"k": 1}, msgpack.ExtType(1, b"x")])
    return _pack(m)


def _missing_or_extra(r):
    m = _valid(r.choice(STAGE_TAKES[:-1]))
    if r.random() < 0.5:
        del m[r.choice([k for k in m if k not in ("v", "t")])]
    else:
        m[r.choice(["extra", "K", "__class__", "k2"])] = r.choice([1, "x", None])
    return _pack(m)


def _truncated(r):
    full = _pack(_valid(r.choice(STAGE_TAKES[:-1])))
    return full[:r.randrange(1, len(full))]


def _trailing(r):
    return _pack(_valid(r.choice(STAGE_TAKES))) + r.randbytes(r.randint(1, 20))


def _foreign_type(r):  # well-formed, but a message that only the head takes
    return _pack(_valid(r.choice(["result", "working", "ready", "stats", "fail"])))


def _bad_values(r, max_chunk=64, max_len=512):
    m = _valid("chunk")
    kind = r.randrange(7)
    if kind == 0:
        m["n"] = 0
    elif kind == 1:
        m["n"] = max_chunk + r.randint(1, 10**6)
    elif kind == 2:
        m["pos"] = max_len - 1
        m["n"] = 2
    elif kind == 3:
        m["pos"] = -r.randint(1, 2**62)
    elif kind == 4:
        m["k"] = -r.randint(1, 2**62)
    elif kind == 5:
        m["kind"] = r.choice(["", "prefill", "CHUNK", "chunk\x00", "x" * 300])
    else:
        m = _valid(r.choice(["taken", "done", "end"]))
        if "k" in m:
            m["k"] = -1
        else:
            m["phase"] = "bogus"
    return _pack(m)


def _near_limit(r):
    return r.randbytes(r.choice([M.MAX_FRAME, M.MAX_FRAME - 1, 65536]))


MAKERS = [_random_bytes, _wrong_shape, _wrong_version, _unknown_type, _huge_ints, _nested_junk,
          _bad_field_types, _missing_or_extra, _truncated, _trailing, _foreign_type, _bad_values]


def garbage(seed: int, n: int, max_chunk: int, max_len: int) -> list[bytes]:
    """n frames, none of which a stage may act on (checked against the stage's own rules)."""
    r = random.Random(seed)
    out = [_near_limit(r) for _ in range(3)]
    while len(out) < n:
        mk = r.choice(MAKERS)
        f = mk(r, max_chunk, max_len) if mk is _bad_values else mk(r)
        if not stage_would_act(f, max_chunk, max_len):
            out.append(f)
    return out


def stage_would_act(frame: bytes, max_chunk: int, max_len: int) -> bool:
    try:
        m = M.as_map(M.decode(frame))
    except M.BadMessage:
        return False
    t = m["t"]
    if t not in STAGE_TAKES:
        return False
    if (t == "end" and m["phase"] not in PHASES) or (t == "chunk" and m["kind"] not in KINDS):
        return False
    if t in ("chunk", "taken", "done") and m["k"] < 0:
        return False
    if t == "chunk" and not (m["pos"] >= 0 and 1 <= m["n"] <= max_chunk and m["pos"] + m["n"] <= max_len):
        return False
    return True


def head_garbage(seed: int, n: int, n_stages: int) -> list[bytes]:
    """Frames for the head's socket: none may be acted on (a well-formed result is never sent:
    the head would take one for a chunk in flight)."""
    r = random.Random(seed)
    out = []
    while len(out) < n:
        if r.random() < 0.4:
            m = _valid(r.choice(["ready", "working", "stats", "fail"]))
            m["stage"] = r.choice([n_stages, n_stages + 1, -1, 2**40])
            f = _pack(m)
        elif r.random() < 0.3:
            f = _pack(_valid(r.choice(STAGE_TAKES)))  # a stage's message, not the head's
        else:
            f = r.choice(MAKERS)(r) if r.random() < 0.9 else _pack({**_valid("result"), "k": -r.randint(1, 9)})
        try:
            m = M.as_map(M.decode(f))
            if m["t"] == "result" and m["k"] >= 0:
                continue
            if m["t"] in ("ready", "working", "stats", "fail") and 0 <= m["stage"] < n_stages:
                continue
        except M.BadMessage:
            pass
        out.append(f)
    return out


# -- the codec alone -----------------------------------------------------------------------------
def test_decode_rejects_only_with_badmessage():
    """20,000 garbled frames through the decoder: each either decodes to a valid message or raises
    BadMessage, never anything else; every message type round-trips."""
    r = random.Random(1)
    ok = bad = 0
    for i in range(20000):
        f = r.choice(MAKERS + [_random_bytes] * 3)(r)
        try:
            M.validate(M.as_map(M.decode(f)))
            ok += 1
        except M.BadMessage:
            bad += 1
    assert bad > 15000 and ok + bad == 20000
    for t in M.SCHEMA:
        m = _valid(t)
        typed = M.decode(_pack(m))
        assert isinstance(typed, M.MESSAGES[t]) and M.as_map(typed) == m
        assert M.decode(M.encode(typed)) == typed
    with pytest.raises(M.BadMessage):
        M.decode(b"\0" * (M.MAX_FRAME + 1))
    for v in (True, 1.0, "1"):  # compare equal to 1 (or look like it) but are not version 1
        with pytest.raises(M.BadMessage, match="version"):
            M.decode(_pack({"v": v, "t": "stop"}))
    with pytest.raises(M.BadMessage, match="out of range"):
        M.decode(_pack({**_valid("taken"), "k": 2**64 - 1}))


# -- a live run ----------------------------------------------------------------------------------
def _sender(ctx, endpoint: str):
    # kept open until the run is over: a PUSH socket closed with frames still queued behind the
    # receiver's high-water mark loses them when its connection goes (ZeroMQ, not Strata)
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def _fuzzed_prefill(p, expect: dict[int, int]):
    """Once each idle stage says (in its log) it has rejected all the garbage sent to it, prefill."""
    deadline = time.monotonic() + 60
    for i, n in expect.items():
        while f"inbox idle: {n} frame(s) rejected so far" not in (p.out / f"stage-{i}.log").read_text():
            assert all(pr.is_alive() for pr in p.procs.res.procs), "a stage died of garbage"
            assert time.monotonic() < deadline, f"stage {i} never reported {n} rejected frames"
            time.sleep(0.02)
    return p.prefill()


@pytest.mark.slow
def test_fuzz_running_stages_and_head(tmp_path, guard):
    from strata.head.pipeline import Pipeline
    rig = make_rig(2, tokens=512, chunk=64, dump_residual=True)

    with Pipeline(rig, out=tmp_path / "clean", console=False) as ref:
        clean = ref.prefill()
        guard.track_pipeline(ref)

    p = Pipeline(rig, out=tmp_path / "fuzzed", console=False)
    guard.run_ids.add(p.run_id)
    ipc = None
    with p:
        p.start()
        guard.track_pipeline(p)
        ipc = p.procs.res.ipc_dir
        max_chunk, max_len = p.plan.max_chunk, p.plan.max_len
        to_stage = {0: garbage(10, 1200, max_chunk, max_len), 1: garbage(11, 1200, max_chunk, max_len)}
        multipart = [[b"junk", b"\x91\x91", _pack(_valid("stop"))[:-1]] for _ in range(5)]  # each part counts
        to_head = head_garbage(12, 400, len(p.stages))
        ctx = zmq.Context()
        socks = []
        try:
            for i, frames in to_stage.items():
                socks.append(_sender(ctx, f"ipc://{ipc}/s{i}"))
                for f in frames:
                    socks[-1].send(f)
                if i == 1:
                    for parts in multipart:
                        socks[-1].send_multipart(parts)
            socks.append(_sender(ctx, f"ipc://{ipc}/head"))
            for f in to_head:
                socks[-1].send(f)
            # frames over MAX_FRAME never reach the stage: ZeroMQ drops them with the connection
            # that sent them (MAXMSGSIZE), so they are sent from a socket of their own, uncounted
            socks.append(_sender(ctx, f"ipc://{ipc}/s1"))
            socks[-1].send(b"\x81" * (M.MAX_FRAME + 1))
            socks[-1].send(b"\0" * (4 * M.MAX_FRAME))
            fuzzed = _fuzzed_prefill(p, {0: len(to_stage[0]), 1: len(to_stage[1]) + 3 * len(multipart)})
        finally:
            for s in socks:
                s.close(linger=0)
            ctx.term()


    expect = {0: len(to_stage[0]), 1: len(to_stage[1]) + 3 * len(multipart)}
    for i, st in enumerate(fuzzed.report["stages"]):
        assert st["bad_frames"] == expect[i], (i, st["bad_frames"], expect[i])
        log = (tmp_path / "fuzzed" / f"stage-{i}.log").read_text()
        assert "rejected frame #1:" in log and "rejected frame #1000:" in log
    assert p.bad_frames == len(to_head)
    # nothing garbled was acted on: the fuzzed run computed exactly what the clean run did
    assert fuzzed.perplexity == clean.perplexity
    assert fuzzed.report["residual_md5"] == clean.report["residual_md5"]
    assert [s["chunks"] for s in fuzzed.report["stages"]] == [8, 8]
    assert sum(len(f) for f in to_stage[0] + to_stage[1]) > 3 * M.MAX_FRAME  # near-limit frames went through
