"""The head: reads a rig file, validates all of it, spawns one process per stage, runs the
prefill (and the continuation), prints the report and writes the run directory.

    python launcher.py --config configs/rig.yaml [--out DIR] [--set key=value ...]

Exit 0 on success; otherwise non-zero with one line starting `error:` on stderr.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys


class Terminated(BaseException):
    """SIGTERM, turned into an exception so the prefill guard and teardown run."""


def _on_term(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="launcher.py", description="Strata: pipelined long-prompt prefill across layer-split stages.")
    ap.add_argument("--config", required=True, metavar="PATH", help="rig file (YAML); see README for every key")
    ap.add_argument("--out", metavar="DIR", help="run directory for report.json, stage logs, timeline.png "
                    "(default: the rig's `out`, else runs/<time>)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                    help="override a rig key (YAML value; dotted keys reach into mappings, e.g. prompt.max_tokens=256); "
                         "repeatable")
    ap.add_argument("--json", action="store_true", help="print report.json to stdout instead of the table")
    ap.add_argument("--no-timeline", action="store_true", help="do not draw timeline.png")
    a = ap.parse_args(argv)

    from strata.config import ConfigError, load
    from strata.pipeline import Pipeline, PipelineError
    from strata.weights import ModelError

    signal.signal(signal.SIGTERM, _on_term)
    try:
        cfg = load(a.config, a.overrides)
        pipe = Pipeline(cfg, out=a.out)
    except (ConfigError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with pipe:
            result = pipe.prefill()
    except PipelineError as e:
        print(f"error: {e} (logs: {pipe.out})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"error: interrupted; all stages stopped (logs: {pipe.out})", file=sys.stderr)
        return 130
    except Terminated:
        print(f"error: terminated; all stages stopped (logs: {pipe.out})", file=sys.stderr)
        return 143
    except (ConfigError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from strata.report import draw_timeline, format_table
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
