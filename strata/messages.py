"""Every message on the wire: msgpack maps with a version and a type, validated on receipt.

Bulk data never travels here; a message says which chunk sits in which shared buffer.
Nothing is unpickled. A frame that does not decode to a known, well-formed message raises
`BadMessage`; receivers count and log it and carry on.

Validation is about shape, not authenticity: a well-formed message of a type the receiver
accepts is acted on. Who may send is decided by where the endpoints live: ipc sockets in a
per-run directory of mode 0700, so only this user reaches them.
"""
from __future__ import annotations

import msgpack

VERSION = 1
MAX_FRAME = 1 << 20  # notes are small; anything larger is not ours


class BadMessage(ValueError):
    pass


_num = (int, float)
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 63) - 1  # every integer field fits an int64
# type -> {field: allowed python types}. Every field is required; extra fields are refused.
SCHEMA: dict[str, dict[str, tuple]] = {
    # head -> stages: a prefill / decode phase begins at monotonic time t0
    "begin": {"phase": (str,), "t0": _num},
    # upstream -> stage: chunk k (pos, n) is in the input buffer (stage 0: in the ids segment)
    "chunk": {"k": (int,), "pos": (int,), "n": (int,), "phase": (str,)},
    # stage -> upstream: chunk k has been copied out of the buffer; the buffer is free
    "taken": {"k": (int,)},
    # stage -> upstream (depth 0): chunk k has gone through the whole rest of the pipeline
    "done": {"k": (int,)},
    # last stage -> head: chunk k finished; last-row logits are in the result buffer
    "result": {"k": (int,), "nll": _num, "count": (int,), "argmax": (int,)},
    # stage -> head: started work on chunk k (progress display)
    "working": {"stage": (int,), "k": (int,)},
    # head -> stage: the phase is over; report timing
    "end": {"phase": (str,)},
    # stage -> head: per-phase timing and events
    "stats": {"stage": (int,), "phase": (str,), "wall_s": _num, "work_s": _num, "handoff_wait_s": _num,
              "input_wait_s": _num, "copy_s": _num, "events": (list,), "chunks": (int,), "bad_frames": (int,)},
    # stage -> head: loaded and mapped; ready to serve
    "ready": {"stage": (int,), "pid": (int,), "device": (str,), "layers": (list,), "mem_bytes": (int,),
              "kv_bytes": (int,), "pinned": (bool,), "load_s": _num},
    # stage -> head: a typed failure, sent before the stage exits
    "fail": {"stage": (int,), "pid": (int,), "device": (str,), "chunk": (int,), "error": (str,),
             "message": (str,), "traceback": (str,)},
    # head -> stage: exit now
    "stop": {},
}


def encode(type_: str, **fields) -> bytes:
    msg = {"v": VERSION, "t": type_, **fields}
    validate(msg)
    return msgpack.packb(msg, use_bin_type=True)


def validate(msg) -> dict:
    if not isinstance(msg, dict):
        raise BadMessage(f"not a map: {type(msg).__name__}")
    v = msg.get("v")
    if type(v) is not int or v != VERSION:  # not True, not 1.0: those compare equal to 1
        raise BadMessage(f"version {v!r}, expected {VERSION}")
    t = msg.get("t")
    schema = SCHEMA.get(t) if isinstance(t, str) else None
    if schema is None:
        raise BadMessage(f"unknown type {t!r}")
    extra = set(msg) - set(schema) - {"v", "t"}
    if extra:
        raise BadMessage(f"{t}: unexpected fields {sorted(map(str, extra))}")
    for name, kinds in schema.items():
        if name not in msg:
            raise BadMessage(f"{t}: missing field {name!r}")
        v = msg[name]
        if isinstance(v, bool) and bool not in kinds:
            raise BadMessage(f"{t}.{name}: bad type bool")
        if not isinstance(v, kinds):
            raise BadMessage(f"{t}.{name}: bad type {type(v).__name__}")
        if isinstance(v, int) and not isinstance(v, bool) and not _INT_MIN <= v <= _INT_MAX:
            raise BadMessage(f"{t}.{name}: integer out of range")
    return msg


def decode(frame: bytes) -> dict:
    if len(frame) > MAX_FRAME:
        raise BadMessage(f"frame of {len(frame)} bytes is larger than any message")
    try:
        # strict_map_key, no ext hooks, bounded sizes: a hostile frame can only fail to decode
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises many types for garbage
        raise BadMessage(f"undecodable frame ({type(e).__name__})") from None
    return validate(msg)
