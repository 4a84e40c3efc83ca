"""The head: reads a rig file, validates all of it, spawns one process per stage, runs the
prefill (and the continuation), prints the report and writes the run directory.

    python launcher.py --config configs/rig.yaml [--out DIR] [--set key=value ...]
    python launcher.py --config configs/rig.yaml --serve [--host 127.0.0.1] [--port 8000] [--api-key KEY]
    strata --config configs/rig.yaml ...        (the same, as the installed console script)

Without a rig file, the common jobs on a model with every other choice the planner's (stages, split, chunk, dtype):

    strata run MODEL (--file DOC | --text TEXT) [--generate N]   a prompt's prefill and a greedy continuation
    strata perplexity MODEL FILE                                 a text file's perplexity
    strata serve MODEL [--host ...] [--port ...]                 the OpenAI-compatible server for several users
    (each takes --set KEY=VALUE, --out, and the flags of its --config form)

Exit 0 on success; otherwise non-zero with one line starting `error:` on stderr.
"""
from __future__ import annotations

import time

_T_IMPORTED = time.perf_counter()  # this module's first line: the start-up clock's fallback

import argparse
import dataclasses
import json
import signal
import sys

_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Stopped(BaseException):
    """SIGINT or SIGTERM while no stage runs (before the pipeline exists, or after it closed); with --serve,
    also while the stages load, and once uvicorn has drained and raised the signal again."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


# the rig a rig-less job starts from (configs/run.yaml's choices): the model and the job's keys go on top
JOB_RIG = {"stages": "auto", "dtype": "auto", "layer_split": "auto", "chunk": "auto"}
JOBS = ("run", "perplexity", "serve")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in JOBS:
        return _job(argv)
    ap = argparse.ArgumentParser(
        prog="strata", description="Strata: pipelined long-prompt prefill across layer-split stages.")
    ap.add_argument("--config", required=True, metavar="PATH", help="rig file (YAML); docs/rig-keys.md has every key")
    ap.add_argument("--out", metavar="DIR", help="run directory for report.json, stage logs, timeline.png "
                    "(default: the rig's `out`, else runs/<time>)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                    help="override a rig key (YAML value; dotted keys reach into mappings, e.g. prompt.max_tokens=256; "
                         "prompt.file=doc.txt replaces the rig's prompt); repeatable")
    ap.add_argument("--json", action="store_true", help="print report.json to stdout instead of the table")
    ap.add_argument("--no-timeline", action="store_true", help="do not draw timeline.png")
    ap.add_argument("--kv-load", metavar="PATH", help="before the prefill, load a KV file (kv_save's) into the stages: "
                    "a prompt that begins with its ids prefills only the rest; refused unless saved for this model "
                    "and rig (with --serve: before the first request; with max_seqs > 1 into the prefix cache)")
    ap.add_argument("--kv-save", metavar="PATH", help="after the prefill (and the continuation), write the stages' KV "
                    "of the prompt with its ids to PATH (strata/kvcache/kv_file.py)")
    ap.add_argument("--serve", action="store_true", help="load the stages once and serve an OpenAI-compatible "
                    "API (/v1/completions, /v1/chat/completions) until SIGTERM / SIGINT")
    ap.add_argument("--host", default="127.0.0.1", help="--serve: address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="--serve: port (default 8000)")
    ap.add_argument("--api-key", default=None, help="--serve: require `Authorization: Bearer KEY`")
    a = ap.parse_args(argv)
    a.rig = None
    return _start(a)


def _job(argv: list[str]) -> int:
    """`strata run | perplexity | serve MODEL ...`: the job's rig made here (JOB_RIG, the model, the prompt), then
    what `--config` would run with it; --set still changes any key."""
    ap = argparse.ArgumentParser(prog="strata", description="Strata's common jobs on a model, no rig file.")
    sub = ap.add_subparsers(dest="job", required=True)
    jobs = {"run": "prefill a prompt and continue it greedily", "perplexity": "a text file's perplexity",
            "serve": "serve an OpenAI-compatible API for several users"}
    p = {j: sub.add_parser(j, help=h, description=h) for j, h in jobs.items()}
    for j, q in p.items():
        q.add_argument("model", metavar="MODEL", help="a .gguf file (a split one by its first part), an HF folder "
                       "or repo id in the local cache, smollm2, or synthetic:PRESET")
        q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                       help="any rig key (docs/rig-keys.md); repeatable")
        q.add_argument("--out", metavar="DIR", help="run directory (default runs/<time>)")
        q.add_argument("--kv-load", metavar="PATH", help="a KV file (kv_save's) loaded before the prompt")
    src = p["run"].add_mutually_exclusive_group(required=True)
    src.add_argument("--file", metavar="DOC", help="the prompt: a UTF-8 text file")
    src.add_argument("--text", metavar="TEXT", help="the prompt: this text")
    p["run"].add_argument("--generate", type=int, default=128, metavar="N", help="greedy tokens after it (128)")
    p["perplexity"].add_argument("file", metavar="FILE", help="a UTF-8 text file")
    for j in ("run", "perplexity"):
        p[j].add_argument("--json", action="store_true", help="print report.json instead of the table")
        p[j].add_argument("--no-timeline", action="store_true", help="do not draw timeline.png")
        p[j].add_argument("--kv-save", metavar="PATH", help="write the stages' KV of the prompt to PATH after it")
    p["serve"].add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p["serve"].add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p["serve"].add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY`")
    a = ap.parse_args(argv)
    rig = {**JOB_RIG, "model": a.model}
    if a.job == "run":
        rig.update(prompt={"file": a.file} if a.file else {"text": a.text}, generate=a.generate, perplexity=False)
    elif a.job == "perplexity":
        rig.update(prompt={"file": a.file}, generate=0, perplexity=True)
    else:
        a.kv_save, a.json, a.no_timeline = None, False, False
    a.config, a.rig, a.serve = None, rig, a.job == "serve"
    return _start(a)


def _load(a):
    """The rig: the --config file's, or a rig-less job's (_job), with --set on top."""
    from strata.config import load, load_dict
    return load(a.config, a.overrides) if a.rig is None else load_dict(a.rig, a.overrides)


def _start(a) -> int:
    if a.serve:
        return _serve(a)

    # Signal handlers only record the signal once the pipeline exists: the head acts on it at a
    # safe point (never between receiving a message and handling it), joins the chunks in
    # flight, then tears everything down. Before that, nothing has started: stop at once.
    head: dict = {}

    def on_signal(signum, frame):
        if "pipe" in head:
            head["pipe"].interrupt(signum)
        else:
            raise Stopped(signum)

    old = {s: signal.signal(s, on_signal) for s in _EXIT}
    try:
        return _run(a, head)
    except Stopped as e:
        print(f"error: stopped by {signal.Signals(e.signum).name} (no stage was running)", file=sys.stderr)
        return _EXIT[e.signum]
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if "strata.head.procs" in sys.modules:
            sys.modules["strata.head.procs"].stop_forkserver()


def _serve(a) -> int:
    """The stages stay up; uvicorn owns SIGINT / SIGTERM while it serves (drain, close the stages), then raises
    the signal again, into this process's own handler: the head ends its helper processes (the fork server, the
    resource tracker) before it exits 130 / 143. Dying of the re-raised signal left those to a supervisor for a
    second or two. Before uvicorn runs (loading), the handler stops the start as a run's does."""
    from strata.config import ConfigError
    from strata.serve.engine import pipeline_engine
    from strata.errors import PipelineError
    from strata.serve.server import run_server
    from strata.weights.checkpoint import ModelError
    loaded = []

    def on_signal(signum, frame):
        raise Stopped(signum)

    def engine(c):
        e = pipeline_engine(c, out=a.out)
        loaded.append(True)
        if a.kv_load:  # before the first request: into the live KV, or (max_seqs > 1) the prefix cache
            try:
                facts = e.kv_load(a.kv_load)
            except BaseException:
                e.close()
                raise
            print(f"kv_load: {facts['tokens']} tokens from {a.kv_load}", file=sys.stderr)
        return e
    old = {s: signal.signal(s, on_signal) for s in _EXIT}
    try:
        if a.kv_save:
            raise ConfigError("--kv-save: not with --serve (the server keeps many prompts' KV: its prefix cache, "
                              "and kv_cache_dir for files that outlive it)")
        if a.kv_load:
            from strata.kvcache.kv_file import read_header
            read_header(a.kv_load)  # not a KV file: refused before any stage starts (the rig's checks come after)
        cfg = _load(a)
        _fork_cpu_stages(cfg)  # CPU stages (and their restarts after a failure) forked ready-made, as in a run
        return run_server(cfg, engine_factory=engine, host=a.host, port=a.port, api_key=a.api_key)
    except Stopped as e:
        if not loaded:
            print(f"error: stopped by {signal.Signals(e.signum).name} while the stages were loading", file=sys.stderr)
        return _EXIT[e.signum]
    except (ConfigError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if "strata.head.procs" in sys.modules:
            sys.modules["strata.head.procs"].stop_forkserver()


def _fork_cpu_stages(cfg) -> None:
    """Start the fork server (torch and the stage code preloaded) while the head imports and plans, when
    this host will run CPU stages: they are then forked ready-made instead of importing torch each."""
    from strata.head.procs import no_gpu_devices, start_forkserver
    if isinstance(cfg.stages, tuple):
        cpu = any(s.device == "cpu" and not s.remote for s in cfg.stages)
    else:  # auto: CPU stages exactly when torch will see no GPU
        cpu = no_gpu_devices()
    if cpu:
        start_forkserver()


def _run(a, head: dict) -> int:
    from strata.config import ConfigError
    from strata.errors import ModelError
    from strata.head.report import process_start
    t_process = min(process_start(), _T_IMPORTED)

    try:
        cfg = _load(a)
    except (ConfigError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _fork_cpu_stages(cfg)  # before this process imports torch: the two imports overlap
    # one prompt and out: no later prompt would be served from the prefix cache's snapshots, so none are taken
    # (a snapshot copies up to prefix_cache_bytes of KV out of every stage after the run)
    cfg = dataclasses.replace(cfg, prefix_cache_bytes=0)
    from strata.head.pipeline import Pipeline, PipelineError
    from strata.head.stage_set import Interrupted
    try:
        pipe = Pipeline(cfg, out=a.out, marks={"process": t_process, "imports": time.perf_counter()})
    except (ConfigError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    head["pipe"] = pipe

    def logs():
        return f" (logs: {pipe.out})" if pipe.out.is_dir() else ""
    try:
        with pipe:
            kv = {}
            if a.kv_load:
                loaded = pipe.kv_load(a.kv_load)
                kv["kv_load"] = {"path": a.kv_load, **{k: loaded[k] for k in ("tokens", "bytes", "seconds")}}
            result = pipe.prefill()
            if a.kv_save:
                kv["kv_save"] = pipe.kv_save(a.kv_save)
            if kv:
                result.report.update(kv)
                (pipe.out / "report.json").write_text(json.dumps(result.report, indent=1))
    except PipelineError as e:
        print(f"error: {e}{logs()}", file=sys.stderr)
        return 1
    except Interrupted as e:
        verb = "interrupted" if e.signum == signal.SIGINT else "terminated"
        print(f"error: {verb} by {signal.Signals(e.signum).name}; stopped {pipe.where()}{logs()}", file=sys.stderr)
        return _EXIT[e.signum]
    except KeyboardInterrupt:  # a SIGINT that came through Python's default handler
        print(f"error: interrupted by SIGINT; stopped {pipe.where()}{logs()}", file=sys.stderr)
        return 130
    except (ConfigError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    head.pop("pipe")  # every stage has exited: a signal from here on stops at once
    from strata.head.report import draw_timeline, format_table
    if not a.no_timeline:
        draw_timeline(result.report, pipe.out / "timeline.png")
    if a.json:
        print(json.dumps(result.report, indent=1))
    else:
        print(format_table(result.report))
        print(f"run directory: {pipe.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
