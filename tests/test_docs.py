"""The documents' checkable claims against the tree (issue 27): README's Layout names every module and bench/ file,
its Environment table every STRATA_* variable config.py reads, ARCHITECTURE's Errors every error class, and each
command of BENCHMARKS' Current figures an existing script with flags it parses. Text only: nothing is imported."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from test_config_kernels import strata_names

ROOT = Path(__file__).resolve().parents[1]


def section(doc: str, start: str, end: str) -> str:
    text = (ROOT / doc).read_text()
    i = text.index(start)
    return text[i:text.index(end, i)]


def test_layout_names_every_module_and_bench_file():
    layout = section("README.md", "## Layout", "## Tests")
    files = [p for pkg in ("strata", "workers") for p in (ROOT / pkg).rglob("*.py")
             if p.name != "__init__.py" or p.parent.name in ("strata", "workers", "quant")]
    files += list((ROOT / "strata" / "kernels" / "csrc").glob("*.c"))
    missing = [str(p.relative_to(ROOT)) for p in sorted(files) if f"`{p.relative_to(ROOT)}`" not in layout]
    # a package's folder has its own row (its __init__.py holds only the docstring that row repeats)
    missing += [f"strata/{d.name}/" for d in sorted((ROOT / "strata").iterdir())
                if (d / "__init__.py").exists() and f"`strata/{d.name}/`" not in layout]
    missing += [f"bench/{p.name}" for p in sorted((ROOT / "bench").iterdir()) if f"`{p.name}`" not in layout]
    assert not missing, f"README's Layout lacks {missing}"


def test_environment_table_is_configs_variables():
    table = set(re.findall(r"^\| `(STRATA_\w+)`", (ROOT / "README.md").read_text(), re.M))
    assert table == strata_names((ROOT / "strata" / "config.py").read_text())


def test_errors_section_names_every_error_class():
    errors = section("ARCHITECTURE.md", "## Errors", "\n## ")
    sources = [p for pkg in ("strata", "workers") for p in (ROOT / pkg).rglob("*.py")] + [ROOT / "launcher.py"]
    classes = {n.name: [ast.unparse(b) for b in n.bases] for p in sources for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.ClassDef)}
    exc = set()
    while True:  # classes whose bases are an exception, a builtin one or one of ours
        more = {c for c, bases in classes.items() if c not in exc and any(
            b in exc or b.endswith(("Error", "Exception")) for b in (x.rpartition(".")[2] for x in bases))}
        if not more:
            break
        exc |= more
    assert {"ConfigError", "PipelineError", "Interrupted", "Stopped", "StageFailed"} <= exc  # the scan sees them
    assert not [c for c in sorted(exc) if f"`{c}`" not in errors], "ARCHITECTURE's Errors lacks some"


def test_current_figures_commands_exist():
    """Each bench/*.py command in the Current figures tables: the script is there and parses every flag used (a
    fragment after the first command, e.g. "then `--llama-only ...`", is the row's last script's)."""
    figures = section("BENCHMARKS.md", "## Current figures", "The rounds follow")
    bad, checked = [], 0
    for row in figures.splitlines():
        cols = [c.strip() for c in row.strip("|").split("|")]
        if not row.startswith("|") or len(cols) < 6 or cols[5] in ("command", "---"):
            continue
        script = None
        for cmd in re.findall(r"`([^`]+)`", cols[5]):
            m = re.search(r"bench/[\w.]+", cmd)
            script = m.group() if m else script
            if script is None:
                continue
            path = ROOT / script
            if not path.exists():
                bad.append(f"{script}: no such file")
                continue
            if script.endswith(".py"):
                parsed = set(re.findall(r'add_argument\(\s*"(--[\w-]+)"', path.read_text()))
                bad += [f"{script} {f}" for f in re.findall(r"(?<![\w-])(--[\w-]+)", cmd) if f not in parsed]
            checked += 1
    assert checked >= 20 and not bad, bad
