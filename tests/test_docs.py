"""The documents' checkable claims against the tree (issues 27, 57): docs/layout.md names every module and bench/
file, docs/kernels.md's table every STRATA_* variable config.py reads, docs/rig-keys.md every rig key with its
default, docs/models.md the code's families, block types and presets, ARCHITECTURE's Errors every error class, and
each command of BENCHMARKS' Current figures an existing script with flags it parses. Text, and the config and model
tables (no torch model is built)."""
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
    layout = (ROOT / "docs" / "layout.md").read_text()
    files = [p for pkg in ("strata", "workers") for p in (ROOT / pkg).rglob("*.py")
             if p.name != "__init__.py" or p.parent.name in ("strata", "workers", "quant")]
    files += list((ROOT / "strata" / "kernels" / "csrc").glob("*.c"))
    missing = [str(p.relative_to(ROOT)) for p in sorted(files) if f"`{p.relative_to(ROOT)}`" not in layout]
    # a package's folder has its own row (its __init__.py holds only the docstring that row repeats)
    missing += [f"strata/{d.name}/" for d in sorted((ROOT / "strata").iterdir())
                if (d / "__init__.py").exists() and f"`strata/{d.name}/`" not in layout]
    missing += [f"bench/{p.name}" for p in sorted((ROOT / "bench").iterdir()) if f"`{p.name}`" not in layout]
    assert not missing, f"docs/layout.md lacks {missing}"


def test_environment_table_is_configs_variables():
    table = set(re.findall(r"^\| `(STRATA_\w+)`", (ROOT / "docs" / "kernels.md").read_text(), re.M))
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
    figures = section("BENCHMARKS.md", "## Current figures", "The dated rounds")
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


def table_rows(text: str) -> dict[str, list[str]]:
    """A markdown page's table rows by their first cell's backticked name: {name: the cells after it}."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        m = re.fullmatch(r"`([^`]+)`", cells[0]) if cells else None
        if m:
            rows[m.group(1)] = cells[1:]
    return rows


def key_type(f) -> str:
    """A rig field's type as docs/rig-keys.md's type column writes it: its choices, or its annotation in words."""
    if f.metadata.get("choices"):
        return "one of " + ", ".join(f"`{c}`" for c in f.metadata["choices"])
    words = {"int": "integer", "float": "number", "bool": "boolean", "str": "string", "None": "none",
             "dict": "mapping", "tuple[int, ...]": "list of integers", "tuple[StageSpec, ...]": "list of stages",
             "PromptSpec": "mapping", "KernelSpec": "mapping", "DebugSpec": "mapping"}
    return " or ".join(words[t.strip()] for t in str(f.type).split(" | "))


def test_rig_keys_page_is_the_config_classes():
    """docs/rig-keys.md has a row for every field of the rig's dataclasses, and no row for a key that is not one;
    its type cell is the field's (key_type), and a plain default (a string, number or boolean) is the row's
    default cell's first value."""
    import yaml
    from dataclasses import MISSING, fields
    from strata.config import KernelSpec, PromptSpec, RigConfig, StageSpec
    rows = table_rows((ROOT / "docs" / "rig-keys.md").read_text())
    rows = {k: v for k, v in rows.items() if not k.startswith("-")}  # the command line's flags
    keys, wrong = set(), []
    for cls, prefix in ((RigConfig, ""), (StageSpec, "stages[i]."), (PromptSpec, "prompt."), (KernelSpec, "kernels.")):
        for f in fields(cls):
            key = prefix + f.name
            keys.add(key)
            if key not in rows:
                wrong.append(f"{key}: no row")
                continue
            if rows[key][0] != key_type(f):
                wrong.append(f"{key}: type {key_type(f)!r}, the page says {rows[key][0]!r}")
            if f.default is MISSING or f.default is None or not isinstance(f.default, (str, int, float)):
                continue
            cell = rows[key][2]
            m = re.match(r"`([^`]*)`", cell)
            given = yaml.safe_load(m.group(1)) if m else None
            gib = re.match(r"([\d.]+) GiB", cell)
            if given != f.default and not (gib and float(gib.group(1)) * 2 ** 30 == f.default):
                wrong.append(f"{key}: default {f.default!r}, the page says {cell!r}")
    wrong += [f"{k}: no such key" for k in rows if k not in keys]
    assert not wrong, wrong


def test_models_page_is_the_codes_tables():
    """docs/models.md: a family row for each of FAMILIES (its HF architectures and GGUF name in it), the block types
    SUPPORTED, and the presets table as PRESETS renders it; "Being added" names no family that is already in."""
    from strata.models.args import PRESETS
    from strata.models.families import FAMILIES
    from strata.quant import SUPPORTED
    page = (ROOT / "docs" / "models.md").read_text()
    fams = section("docs/models.md", "## Families", "\n## ")
    rows = {}
    for line in fams.splitlines():
        cells = [c.strip() for c in line.strip().split("|")[1:-1]]
        if len(cells) >= 3 and cells[0] not in ("family", "---"):
            rows.setdefault(cells[0].split(" + ")[0], []).append(" ".join(cells[1:3]))
    assert set(rows) == set(FAMILIES), (sorted(rows), sorted(FAMILIES))
    for name, fam in FAMILIES.items():
        text = " ".join(rows[name])
        assert all(f"`{a}`" in text for a in fam.hf_architectures) and f"`{fam.gguf_arch}`" in text, name
    adding = re.search(r"^Being added: (.*?)\.", page, re.M | re.S).group(1)
    assert not [f for f in ("deepseek", "kimi") if any(f in n for n in FAMILIES)] or "DeepSeek" not in adding
    types = section("docs/models.md", "## GGUF block types", "\n## ")
    assert re.findall(r"`([A-Z0-9_]+)`", types.split("; the")[0]) == list(SUPPORTED)
    want = [preset_row(n, a) for n, a in PRESETS.items()]
    got = [line for line in page.splitlines() if re.match(r"^\| `[^`]+` \| \w+ \| \d", line)]
    assert got == want, "docs/models.md's presets should read:\n" + "\n".join(want)


def preset_row(name: str, a) -> str:
    experts = f"{a.n_experts_used} of {a.n_experts}" if a.n_experts else "—"
    return f"| `{name}` | {a.arch} | {a.n_layers} | {a.dim} | {a.n_heads} / {a.n_kv_heads} | {experts} | {a.max_seq_len:,} |"


def numbers(text: str) -> list[float]:
    return [float(n.replace(",", "")) for n in re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?", text)]


def test_readme_measured_table_is_benchmarks_current_figures():
    """Each "X vs Y (Rx)" of the README's Measured table: X in the Strata column and Y in the llama.cpp column of one
    row of BENCHMARKS.md's Current figures, and R their ratio (issue 57: the README's table had drifted from it)."""
    table = section("README.md", "## Measured", "\n## ")
    figures = section("BENCHMARKS.md", "## Current figures", "The dated rounds")
    rows = [[c.strip() for c in r.strip().strip("|").split("|")] for r in figures.splitlines() if r.startswith("|")]
    pairs = re.findall(r"([\d,]+\.\d|[\d,]+) vs ([\d,]+\.\d|[\d,]+) \(([\d.]+)x", table)
    assert len(pairs) >= 12, pairs
    for x, y, ratio in pairs:
        a, b = float(x.replace(",", "")), float(y.replace(",", ""))
        assert any(len(r) > 3 and a in numbers(r[2]) and b in numbers(r[3]) for r in rows), f"{x} vs {y}"
        assert abs(a / b - float(ratio)) < 0.006, f"{x} vs {y} is {a / b:.3f}x, not {ratio}x"


def test_readme_families_are_the_registry():
    """The README's "Supported families" names FAMILIES in its order, and "Being added" none of them."""
    from strata.models.families import FAMILIES
    text = (ROOT / "README.md").read_text()
    line = re.search(r"Supported families \(from `strata/models/families.py`\): (.*?)\. Being added: (.*?)\.", text,
                     re.S)
    named = [re.match(r"\s*(\w+)", part).group(1) for part in re.split(r",(?![^(]*\))", line.group(1))]
    assert named == list(FAMILIES)
    adding = line.group(2).lower()
    assert not [f for f in FAMILIES if f.split("_")[0] in adding], adding


def test_readme_links_and_commands():
    """Every relative link of the README and the docs pages names a file that exists; the README's full test command
    is the one .ci/run runs, and its quick one deselects the marker pyproject registers."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name}: {target}"
    readme = (ROOT / "README.md").read_text()
    tests = readme[readme.index("## Tests"):]
    commands = re.findall(r"```bash\n(.*?)\n```", tests, re.S)
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci and commands[0] == '.venv/bin/python -m pytest -q -m "not slow"', commands
    assert '"slow: ' in (ROOT / "pyproject.toml").read_text()


def test_serving_metrics_table_is_the_servers():
    """docs/serving.md's `/metrics` table names every metric the server and engine write, with its strata_ prefix."""
    code = "".join((ROOT / "strata" / "serve" / f).read_text() for f in ("server.py", "engine.py"))
    names = set(re.findall(r'metric\(\s*"(\w+)"', code)) | set(re.findall(r'"# HELP strata_(\w+) ', code))
    page = (ROOT / "docs" / "serving.md").read_text().split("## `/metrics`")[1]
    table = set(re.findall(r"^\| `strata_(\w+)` \|", page, re.M))
    assert table == names, (sorted(names - table), sorted(table - names))


def test_benchmarks_summary_is_current_figures():
    """Each row of BENCHMARKS.md's Summary: its Strata and llama.cpp figures in one row of Current figures (in those
    columns), and each ratio theirs; every link of Current figures names a round of docs/benchmarks-log.md."""
    summary = section("BENCHMARKS.md", "## Summary", "## Current figures")
    figures = section("BENCHMARKS.md", "## Current figures", "The dated rounds")
    current = [[c.strip() for c in r.strip().strip("|").split("|")] for r in figures.splitlines() if r.startswith("|")]
    checked = 0
    for line in summary.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 7 or cells[3] in ("Strata", "---:"):
            continue
        ours, theirs, ratios = numbers(cells[3]), numbers(cells[4]), numbers(cells[5])
        assert any(len(r) > 3 and set(ours) <= set(numbers(r[2])) and set(theirs) <= set(numbers(r[3]))
                   for r in current), line
        assert len(ours) == len(theirs) == len(ratios), line
        for a, b, x in zip(ours, theirs, ratios):
            assert abs(a / b - x) < 0.006, f"{line}: {a} / {b} is {a / b:.3f}, not {x}"
        checked += 1
    assert checked >= 20, checked
    log = (ROOT / "docs" / "benchmarks-log.md").read_text()
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", log, re.M)}
    links = re.findall(r"\]\(docs/benchmarks-log\.md#([^)]+)\)", figures)
    assert links and not [a for a in links if a not in slugs]
