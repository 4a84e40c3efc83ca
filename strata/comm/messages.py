"""Every message on the wire: one frozen dataclass per type, sent as a msgpack map with a version
and a type, validated on receipt and decoded into its dataclass (`encode(msg)` / `decode(frame)`).

Bulk data never travels here; a message says which chunk sits in which shared buffer.
Nothing is unpickled. A frame that does not decode to a known, well-formed message raises
`BadMessage`; receivers count and log it and carry on.

Validation is about shape, not authenticity: a well-formed message of a type the receiver
accepts is acted on. Who may send is decided by where the endpoints live: ipc sockets in a
per-run directory of mode 0700, so only this user reaches them; across hosts, tcp sockets that
only a peer holding one of the run's CurveZMQ keys can connect to (strata/comm/curve.py).

The stage's spec is a dataclass too (`StageJob`, with `StageNet`): a local stage gets it as its
process argument; a remote stage from the head as one msgpack frame (`encode_spec` / `decode_spec`),
checked field by field before anything is built from it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import ClassVar, get_type_hints

import msgpack

VERSION = 1
MAX_FRAME = 1 << 20  # notes are small; anything larger is not ours
MAX_SCORED_TOP = 20  # a scored chunk's alternatives per target (OpenAI's limit)
MAX_AHEAD = 64  # a decode batch's steps past its note (strata.config.MAX_BATCH_AHEAD)
SCORED_BYTES = MAX_FRAME // 2  # a scored chunk's rows stay under this in its result (the head cuts the chunks)


class BadMessage(ValueError):
    pass


_num = (int, float)
_NONE = type(None)
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 63) - 1  # every integer field fits an int64
PHASES = ("prefill", "decode")


class Kind(StrEnum):
    """What a micro-batch (`Chunk`) is: it decides how a stage runs it and which of Chunk's fields it uses."""
    CHUNK = "chunk"  # rows [pos, pos + n) of one sequence's prompt in `slot`: a prefill (or scored) chunk
    STEP = "step"    # one decode step of one sequence: row `pos` of `slot` (n = 1)
    BATCH = "batch"  # one decode step of each of n sequences: [slot, pos] of each row in `seqs`
    GROUP = "group"  # several sequences' prefill chunks as one: [slot, pos] of each in `seqs`, their rows in `lens`


DECODE_KINDS = (Kind.STEP, Kind.BATCH)  # the "decode" phase's; CHUNK and GROUP are the "prefill" phase's


class Message:
    """A wire message: a frozen dataclass whose fields are the map's keys (besides "v" and "t")."""
    TYPE: ClassVar[str]


def _message(type_: str):
    def wrap(cls):
        cls.TYPE = type_
        return dataclass(frozen=True)(cls)
    return wrap


# upstream -> stage: chunk k (pos, n) is in the input buffer (stage 0: in the ids segment).
# t0 is the head's clock when the phase began; it rides with the chunk so that a stage learns
# of a new phase in stream order (a separate note from the head could overtake or trail it)
@_message("chunk")
class Chunk(Message):
    k: int
    kind: str        # a Kind
    pos: int
    n: int
    t0: float
    tokens: int      # the prompt's length (prefill: the last stage's perplexity targets end there)
    score: int       # prefill: -1, or the last stage scores each target and sends its `score` likeliest tokens
    slot: int = 0    # the sequence's KV slot on every stage (0..max_seqs-1); its ids at slot x (max_len + 1)
    seqs: list = field(default_factory=list)  # a batch or a group: [slot, pos] of each sequence, flat (pos and
                                              # slot above unused); else empty
    keep: bytes = b""  # a prefill chunk: after it, each stage keeps its slot's linear-attention and window layers'
                       # states under this key (strata.kvcache.prefix_cache: Snapshots.keep_state); b"": none
    rows: bool = True  # a decode batch: the last stage puts its logits rows in the result buffer (False: every
                       # row is greedy and only the argmaxes are read: 16 rows of a 128,256 vocabulary are 8 MB)
    ahead: int = 0     # a decode batch on one stage (all rows greedy, rows False): after its step, this many more
                       # on its own argmaxes at the next positions; the result's argmaxes are every step's, step-major
    span: list = field(default_factory=list)  # a prefill chunk with a KV pool (kv_pool): [offset, positions], the
                                              # slot's extent of the pool (Transformer.place_slot); []: no pool
    lens: list = field(default_factory=list)  # a prefill group (Transformer.forward_group): each sequence's rows,
                                              # in row order, with [slot, pos] of each in seqs and [offset,
                                              # positions] of each in span (a KV pool); the result's argmaxes are
                                              # each one's last row's

    @property
    def phase(self) -> str:
        """The phase a stage times it under: "decode" for a step or a batch, else "prefill"."""
        return "decode" if self.kind in DECODE_KINDS else "prefill"


@_message("taken")   # stage -> upstream: chunk k has been copied out of the buffer; the buffer is free
class Taken(Message):
    k: int


@_message("done")    # stage -> upstream (depth 0): chunk k has gone through the whole rest of the pipeline
class Done(Message):
    k: int


@_message("result")  # last stage -> head: chunk k finished; last-row logits are in the result buffer
class ChunkResult(Message):
    k: int
    nll: float
    count: int
    argmax: int
    scores: bytes    # a scored chunk (Chunk.score >= 0): its targets' log-probabilities (float32), then the top
                     # tokens' ids (int32) and log-probabilities (float32), `score` a target; else empty
    argmaxes: list = field(default_factory=list)  # a decode batch: each row's argmax (its logits row t at
                                                  # t x vocab of the result buffer); else empty


@_message("working")  # stage -> head: started work on chunk k (progress display)
class Working(Message):
    stage: int
    k: int


@_message("end")     # head -> stage: the phase is over; report timing
class End(Message):
    phase: str


@_message("stats")   # stage -> head: per-phase timing and events
class Stats(Message):
    stage: int
    phase: str
    wall_s: float
    work_s: float
    handoff_wait_s: float
    input_wait_s: float
    copy_s: float
    events: list
    chunks: int
    bad_frames: int
    peak_bytes: int            # a CUDA stage's most allocated bytes in the phase (weights and KV included); 0 on CPU


@_message("ready")   # stage -> head: loaded and mapped; ready to serve
class Ready(Message):
    stage: int
    pid: int
    device: str
    layers: list
    mem_bytes: int
    kv_bytes: int
    pinned: bool
    load_s: float
    weights: str               # what the stage holds: "resident" (GGUF blocks) or "dequantized"
    weight_bytes: int          # weights as stored on the device
    scratch_bytes: int         # the one-layer dequantization scratch (0 when dequantized)
    warm_s: float              # of load_s: running the schedule's chunk shape once (CUDA kernel set-up)
    state_bytes: int = 0       # linear-attention layers' states (fixed size; not KV)


@_message("fail")    # stage -> head: a typed failure, sent before the stage exits
class Fail(Message):
    stage: int
    pid: int
    device: str
    chunk: int
    error: str
    message: str
    traceback: str


@_message("stop")    # head -> stage: exit now
class Stop(Message):
    pass


# -- across hosts (strata/head/net.py, workers/join.py); only a run with a remote stage sends or accepts these --
@_message("join")    # remote stage -> head (control socket): give me my spec; `clock`: its perf_counter when sent
class Join(Message):
    pid: int
    host: str
    boot_id: str
    clock: float


@_message("hb")      # head <-> remote stage (control socket): still here
class Heartbeat(Message):
    stage: int


@_message("bound")   # stage -> head: its tcp inbox (a neighbour is on another host, or it is remote itself)
class Bound(Message):
    stage: int
    endpoint: str


@_message("peers")   # head -> stage: the tcp inboxes and CURVE public keys of its neighbours ("" = not over tcp)
class Peers(Message):
    up: str
    up_key: str
    down: str
    down_key: str


@_message("token")   # head -> remote stage 0 (decode): the token at `pos` (the ids segment is not shared across hosts)
class Token(Message):
    pos: int
    id: int


@_message("ids")     # head -> remote stage 0 (a new prompt): token ids from `pos` on (sent in slices under MAX_FRAME)
class Ids(Message):
    pos: int
    ids: list


@_message("rejected")  # stage -> head: its tcp sockets refused `count` handshakes so far; the latest why
class Rejected(Message):
    stage: int
    count: int
    detail: str


# -- the prefix cache and KV files (strata/kvcache/prefix_cache.py, strata/kvcache/kv_file.py) -----------------------------------
# With one sequence they come between prompts; with several (max_seqs > 1) a snap or restore names a slot that has
# nothing in flight while other slots' chunks may be (strata/head/slots.py)
KV_OPS = ("snap", "restore", "drop", "save", "load", "open", "unlink")  # open, unlink: the disk tier
KEY_BYTES = 16  # a block key (strata.kvcache.prefix_cache.KEY_BYTES)


@_message("kv")      # head -> stage: snapshot / restore / drop blocks of a slot's KV, or write / read a KV file
class KvOp(Message):
    op: str          # one of KV_OPS
    keys: list       # snap, restore, drop: block keys (16 bytes each)
    blocks: list     # snap, restore: the block index of each key (rows [j * block, (j + 1) * block))
    block: int       # tokens a block
    path: str        # save, load: the file
    offset: int      # save, load: where this stage's first layer's rows start in it
    tokens: int      # save, load: rows [0, tokens)
    slot: int = 0    # snap, restore: the sequence's KV slot (0..max_seqs-1), read or written without use_slot
    state: bytes = b""  # restore: the states kept under this key too (linear-attention and window layers'), at `tokens`
    span: list = field(default_factory=list)  # an op on a slot with a KV pool: its extent [offset, positions]


@_message("kv_done")  # stage -> head: a KvOp is done ("" = done, else the one-line error)
class KvDone(Message):
    stage: int
    op: str
    error: str
    held_bytes: int  # the stage's snapshots, after the op
    device_blocks: int = 0  # the blocks its device tier holds (prefix_cache_device_bytes), after the op
    device_hits: int = 0    # blocks restored from its device tier so far
    keys: list = field(default_factory=list)  # open: the blocks whose files the stage's folder holds, oldest first
    states: list = field(default_factory=list)  # open: the kept states whose files it holds, likewise


MESSAGES: dict[str, type[Message]] = {c.TYPE: c for c in (Chunk, Taken, Done, ChunkResult, Working, End, Stats, Ready,
                                                        Fail, Stop, Join, Heartbeat, Bound, Peers, Token, Ids,
                                                        Rejected, KvOp, KvDone)}
_KINDS = {int: (int,), float: (int, float), str: (str,), bool: (bool,), list: (list,), bytes: (bytes,)}
# type -> {field: allowed python types}, derived from the dataclasses. Every field is required; extra ones refused.
SCHEMA: dict[str, dict[str, tuple]] = {t: {f.name: _KINDS[get_type_hints(c)[f.name]] for f in fields(c)}
                                       for t, c in MESSAGES.items()}


def encode(msg: Message) -> bytes:
    """A typed message -> one msgpack frame (checked as the receiver will check it)."""
    m = {"v": VERSION, "t": msg.TYPE, **{f.name: getattr(msg, f.name) for f in fields(msg)}}
    validate(m)
    return msgpack.packb(m, use_bin_type=True)


def as_map(msg: Message) -> dict:
    """What `encode` puts on the wire, as a map (for tests and logs)."""
    return {"v": VERSION, "t": msg.TYPE, **{f.name: getattr(msg, f.name) for f in fields(msg)}}


def validate(msg) -> dict:
    """A decoded map: version, a known type, exactly its fields with their types, integers in int64,
    chunk indices >= 0 and phases known. Raises BadMessage."""
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
    if t in ("chunk", "taken", "done", "result", "working") and msg["k"] < 0:
        raise BadMessage(f"{t}: negative chunk index {msg['k']}")
    if t == "chunk" and msg["slot"] < 0:
        raise BadMessage(f"chunk: negative slot {msg['slot']}")
    if (t == "chunk" and len(msg["keep"]) not in (0, KEY_BYTES)) or (t == "kv" and len(msg["state"]) not in (0, KEY_BYTES)):
        raise BadMessage(f"{t}: a state key is {KEY_BYTES} bytes")
    if t == "chunk":
        _check_kind(msg)
    spans = len(msg["lens"]) if t == "chunk" and msg["lens"] else 1  # (a prefill group: one a sequence)
    if t in ("chunk", "kv") and not (msg["span"] == [] or (len(msg["span"]) == 2 * spans and all(
            type(v) is int and 0 <= v <= _INT_MAX for v in msg["span"]))):
        raise BadMessage(f"{t}: a span is [offset, positions] of the KV pool")
    if t == "chunk" and msg["kind"] == Kind.GROUP:
        sq, ln = msg["seqs"], msg["lens"]
        if not (len(sq) == 2 * len(ln) and msg["score"] < 0 and not msg["keep"]
                and all(type(v) is int and 0 <= v <= _INT_MAX for v in sq)
                and all(type(v) is int and 1 <= v <= _INT_MAX for v in ln) and sum(ln) == msg["n"]):
            raise BadMessage(f"chunk: a prefill group names [slot, pos] and the rows of each sequence, {msg['n']} "
                             "rows in all, unscored")
        if len(set(sq[0::2])) != len(ln):
            raise BadMessage("chunk: a prefill group takes a sequence once")
    elif t == "chunk" and msg["kind"] == Kind.BATCH:
        sq = msg["seqs"]
        if not (len(sq) == 2 * msg["n"]
                and all(type(v) is int and 0 <= v <= _INT_MAX for v in sq)):
            raise BadMessage(f"chunk: a decode batch names [slot, pos] of each of its {msg['n']} rows")
        if len(set(sq[0::2])) != msg["n"]:
            raise BadMessage("chunk: a decode batch steps a sequence once")
    if t == "chunk" and not (0 <= msg["ahead"] <= MAX_AHEAD
                             and (not msg["ahead"] or (msg["kind"] == Kind.BATCH and not msg["rows"]))):
        raise BadMessage(f"chunk: ahead {msg['ahead']}: 0 to {MAX_AHEAD}, and only for a decode batch without rows")
    if t == "result" and not all(type(v) is int and 0 <= v <= _INT_MAX for v in msg["argmaxes"]):
        raise BadMessage("result: argmaxes must be token ids")
    if t == "chunk" and not 0 < msg["tokens"]:
        raise BadMessage(f"chunk: prompt length {msg['tokens']}")
    if t == "chunk" and not -1 <= msg["score"] <= MAX_SCORED_TOP:
        raise BadMessage(f"chunk: score {msg['score']} outside -1..{MAX_SCORED_TOP}")
    if t in ("end", "stats") and msg["phase"] not in PHASES:
        raise BadMessage(f"{t}: unknown phase {msg['phase']!r}")
    if t in ("kv", "kv_done") and msg["op"] not in KV_OPS:
        raise BadMessage(f"{t}: unknown op {msg['op']!r}")
    if t == "kv_done" and not all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in msg["keys"] + msg["states"]):
        raise BadMessage(f"kv_done: keys must be {KEY_BYTES} bytes each")
    if t == "kv":
        if not all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in msg["keys"]):
            raise BadMessage(f"kv: keys must be {KEY_BYTES} bytes each")
        if not all(type(j) is int and 0 <= j for j in msg["blocks"]) or msg["block"] < 1:
            raise BadMessage("kv: bad block indices or block size")
        if msg["op"] in ("snap", "restore") and len(msg["blocks"]) != len(msg["keys"]):
            raise BadMessage("kv: one block index a key")
        if msg["offset"] < 0 or msg["tokens"] < 0 or msg["slot"] < 0:
            raise BadMessage("kv: negative offset, tokens or slot")
    return msg


def _check_kind(msg: dict) -> None:
    """A chunk's kind is known and it carries the fields of its kind alone (seqs: a batch's or a group's; lens: a
    group's; a step is one row)."""
    kind = msg["kind"]
    if kind not in Kind.__members__.values():
        raise BadMessage(f"chunk: unknown kind {kind!r}")
    if bool(msg["seqs"]) != (kind in (Kind.BATCH, Kind.GROUP)) or bool(msg["lens"]) != (kind == Kind.GROUP):
        raise BadMessage(f"chunk: a {kind} with{'' if msg['seqs'] else 'out'} seqs and with"
                         f"{'' if msg['lens'] else 'out'} lens")
    if kind == Kind.STEP and msg["n"] != 1:
        raise BadMessage(f"chunk: a decode step of {msg['n']} rows")


def _unpack(frame: bytes, limit: int, what: str):
    """msgpack -> Python, bounded: strict_map_key, no ext hooks; a hostile frame can only fail."""
    if len(frame) > limit:
        raise BadMessage(f"{what} of {len(frame)} bytes is larger than any {what}")
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises many types for garbage
        raise BadMessage(f"undecodable {what} ({type(e).__name__})") from None


def decode(frame: bytes) -> Message:
    """One frame -> its typed message, or BadMessage."""
    m = validate(_unpack(frame, MAX_FRAME, "frame"))
    if m["t"] == "chunk":
        m["kind"] = Kind(m["kind"])
    return MESSAGES[m["t"]](**{k: v for k, v in m.items() if k not in ("v", "t")})


# -- a remote stage's spec (the head's join reply) -----------------------------------------------------
_SCALAR = (int, float, str, bool, type(None))
@dataclass
class StageNet:
    """A stage's network facts (a run with a remote stage): which boundaries cross hosts, its keys, the heartbeats."""
    host: str                  # where it runs ("local": this machine)
    remote: bool
    bind: str                  # the address its tcp inbox binds on ("" for a remote stage: its route to the head)
    tcp_in: bool               # its input boundary crosses hosts
    tcp_out: bool              # its output boundary (or, last stage, its result) crosses hosts
    tcp_inbox: bool            # it listens on tcp
    public: str                # its CURVE keypair (a remote stage brings its own secret)
    secret: str
    head_public: str
    allow: list                # public keys that may connect to its tcp inbox
    head_tcp: str              # the head's tcp notes endpoint
    heartbeat_s: float
    heartbeat_timeout_s: float
    head_clock: float          # the head's perf_counter when it answered the join (0 until then)
    boot_id: str               # the head's kernel boot id: same kernel, same clock


@dataclass
class StageJob:
    """Everything a stage process needs: built by the head (StageSet._spec), read by attribute in the stage.
    A remote stage gets it as one msgpack map, checked by `validate_spec` before anything is built from it."""
    index: int
    n_stages: int
    device: str                # "cpu" or "cuda:N"
    dtype: str
    attention: str             # the rig's `attention`
    weights: str               # the rig's `weights` (issue 12)
    kv_dtype: str              # the rig's `kv_dtype` (issue 12)
    memory: int | None         # the rig's `stages[i].memory`: enforced on CUDA
    threads: int | None
    cores: list
    start: int                 # layers [start, end)
    end: int
    model: str
    args: dict                 # ModelArgs fields
    seed: int
    max_len: int               # KV positions: prompt + continuation
    tokens: int
    max_chunk: int
    prefix_block: int          # an 8-bit cache's prefix positions widened at once (the planner's, by memory)
    dynamic_chunks: bool       # the rig's `dynamic_chunks`: the stage warms the schedule's own chunk shapes
    depth: int
    max_seqs: int              # sequences whose KV the stage holds (slots); > 1: decode steps say "taken" too
    kv_pool: int               # the rig's kv_pool: a global layer's positions for every slot (0: max_len a slot)
    prefix_device_bytes: int   # the prefix cache's device tier (a CUDA stage's; the planner counted it), 0: none
    decode_batch: str          # the rig's `decode_batch`: a torch stage multiplies a decode batch's rows at once
    perplexity: bool
    segments: dict             # what -> (shared segment name, bytes); empty for a remote stage
    endpoints: list            # every stage's ipc inbox; empty for a remote stage
    head_endpoint: str
    log_file: str              # "" for a remote stage: it logs to stderr
    console: bool
    dump_residual: str         # the path of residual.npy, or ""
    decode_weights: str        # the rig's `decode_weights` (CPU: weight-only copies for decode steps)
    cuda_graphs: bool          # the rig's `cuda_graphs`
    decode_ahead: bool         # queue the next decode step behind a GPU wait on the bell (kernels.decode_ahead)
    kernels: dict              # KernelSpec fields: the head's, not this host's environment
    debug: dict                # DebugSpec fields
    net: StageNet | None = None  # None: every stage of the run is on this host


def _spec_kinds(cls) -> dict[str, tuple]:
    hints = get_type_hints(cls)
    plain = {int: (int,), float: _num, str: (str,), bool: (bool,), list: (list,), dict: (dict,)}
    out = {}
    for f in fields(cls):
        h = hints[f.name]
        args = [a for a in getattr(h, "__args__", (h,)) if a is not _NONE]
        kinds = plain.get(args[0], (dict,))  # a nested dataclass travels as a map
        out[f.name] = kinds + ((_NONE,) if len(args) < len(getattr(h, "__args__", (h,))) and f.name != "net" else ())
    return out


SPEC: dict[str, tuple] = _spec_kinds(StageJob)   # on the wire `net` is required: only remote stages get a spec
SPEC_NET: dict[str, tuple] = _spec_kinds(StageNet)
SPEC_DEBUG = ("delay_s", "delay_step_s", "fail_stage", "fail_chunk", "fail_mode", "fail_phase", "memory_trace")
MAX_SPEC = 1 << 20


def _fields(where: str, d: dict, schema: dict) -> None:
    if set(d) != set(schema):
        raise BadMessage(f"{where}: fields {sorted(map(str, set(d) ^ set(schema)))} missing or unexpected")
    for name, kinds in schema.items():
        v = d[name]
        if (isinstance(v, bool) and bool not in kinds) or not isinstance(v, kinds):
            raise BadMessage(f"{where}.{name}: bad type {type(v).__name__}")


def _plain(where: str, v, depth: int = 0) -> None:
    """Scalars, and (one level down) maps of scalars: what model args hold (rope_scaling)."""
    if isinstance(v, dict) and depth == 0:
        for k, x in v.items():
            if not isinstance(k, str):
                raise BadMessage(f"{where}: non-string key")
            _plain(f"{where}.{k}", x, 1)
    elif not isinstance(v, _SCALAR):
        raise BadMessage(f"{where}: bad type {type(v).__name__}")


def validate_spec(spec) -> dict:
    """A remote stage's spec, as it arrives from the head: every field present and typed, values in
    range; a remote stage maps no shared memory and reaches no ipc endpoint, so those must be empty."""
    if not isinstance(spec, dict):
        raise BadMessage("spec: not a map")
    _fields("spec", spec, SPEC)
    _fields("spec.net", spec["net"], SPEC_NET)
    s, net = spec, spec["net"]
    if not (0 <= s["index"] < s["n_stages"] and 0 <= s["start"] < s["end"]):
        raise BadMessage("spec: stage index or layer range out of range")
    if not (1 <= s["tokens"] <= s["max_len"] and 1 <= s["max_chunk"] <= s["max_len"] and s["depth"] in (0, 1)
            and s["max_seqs"] >= 1 and s["prefix_block"] >= 1 and s["prefix_device_bytes"] >= 0
            and (s["kv_pool"] == 0 or (s["max_seqs"] > 1 and s["kv_pool"] >= s["max_len"]))):
        raise BadMessage("spec: tokens, max_len, max_chunk, prefix_block, prefix_device_bytes, kv_pool or depth out of "
                         "range")
    from strata.config import ATTENTION, DECODE_BATCH, DECODE_WEIGHTS, DTYPES, KV_DTYPES, WEIGHTS, device_syntax_ok
    for name, choices in (("dtype", DTYPES), ("attention", ATTENTION), ("weights", WEIGHTS), ("kv_dtype", KV_DTYPES),
                          ("decode_weights", DECODE_WEIGHTS), ("decode_batch", DECODE_BATCH)):
        if s[name] not in choices:
            raise BadMessage(f"spec.{name}: {s[name]!r}")
    if not device_syntax_ok(s["device"]):
        raise BadMessage(f"spec.device: {s['device']!r}")
    if not all(type(c) is int and c >= 0 for c in s["cores"]) or (s["threads"] is not None and s["threads"] <= 0):
        raise BadMessage("spec: bad cores or threads")
    if not net["remote"] or s["segments"] or s["endpoints"] or s["log_file"]:
        raise BadMessage("spec: a remote stage maps no shared memory, reaches no ipc endpoint, logs to stderr")
    if not all(isinstance(k, str) for k in net["allow"]) or not net["head_tcp"].startswith("tcp://"):
        raise BadMessage("spec.net: bad allow list or head endpoint")
    if not (0 < net["heartbeat_s"] < net["heartbeat_timeout_s"]):
        raise BadMessage("spec.net: heartbeat_s must be > 0 and below heartbeat_timeout_s")
    for name in ("args", "debug"):
        _plain(f"spec.{name}", s[name])
    from strata.config import ConfigError, KernelSpec, kernel_spec
    if set(s["kernels"]) != {f.name for f in fields(KernelSpec)}:
        raise BadMessage(f"spec.kernels: fields {sorted(map(str, s['kernels']))}, expected KernelSpec's")
    try:
        kernel_spec(s["kernels"])
    except ConfigError as e:
        raise BadMessage(f"spec.{e}") from None
    missing = [k for k in SPEC_DEBUG if k not in s["debug"]]
    if missing:
        raise BadMessage(f"spec.debug: missing {missing}")
    return spec


def encode_spec(job: StageJob) -> bytes:
    return msgpack.packb(validate_spec(asdict(job)), use_bin_type=True)


def decode_spec(frame: bytes) -> StageJob:
    d = validate_spec(_unpack(frame, MAX_SPEC, "spec"))
    return StageJob(**{**d, "net": StageNet(**d["net"])})
