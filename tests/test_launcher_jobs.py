"""The rig-less jobs (`strata run | perplexity | serve MODEL ...`, issue 57 item 3): the same runs as their --config
forms with configs/run.yaml, refusals in one line before anything starts, and the server answering."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import launcher

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smollm2():
    from strata.weights.checkpoint import smollm2_path
    try:
        smollm2_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))


def report(capsys, argv) -> dict:
    assert launcher.main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_perplexity_job_is_the_config_run(smollm2, tmp_path, capsys):
    """`strata perplexity MODEL FILE` computes what `--config configs/run.yaml --set prompt.file=FILE --set
    generate=0` does: the same tokens, dtype, split and perplexity."""
    doc = tmp_path / "doc.txt"
    doc.write_text((ROOT / "RELIABILITY.md").read_text()[:3000])
    job = report(capsys, ["perplexity", "smollm2", str(doc), "--json", "--no-timeline", "--out", str(tmp_path / "a")])
    cfg = report(capsys, ["--config", str(ROOT / "configs/run.yaml"), "--set", f"prompt.file={doc}", "--set",
                          "generate=0", "--json", "--no-timeline", "--out", str(tmp_path / "b")])
    for key in ("tokens", "dtype", "perplexity"):
        assert job[key] == cfg[key], key
    assert job["perplexity"] > 1


@pytest.mark.slow
def test_run_job_continues_the_text(smollm2, tmp_path, capsys):
    """`strata run MODEL --text T --generate N`: the greedy continuation, as the quick start's."""
    r = report(capsys, ["run", "smollm2", "--text", "The capital of France is", "--generate", "4", "--json",
                        "--no-timeline", "--set", "generate=3", "--out", str(tmp_path / "r")])
    assert r["continuation"].startswith(" Paris") and len(r["continuation_ids"]) == 3  # (--set over --generate)


@pytest.mark.parametrize("argv,says", [
    (["run", "/nowhere/model.gguf", "--text", "hi"], "model '/nowhere/model.gguf' not found"),
    (["perplexity", "smollm2", "/nowhere/doc.txt"], "/nowhere/doc.txt"),
    (["run", "smollm2", "--text", "hi", "--set", "chunk=-3"], "chunk"),
])
def test_a_bad_job_is_refused_in_one_line(smollm2, tmp_path, capsys, argv, says):
    assert launcher.main(argv + ["--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
    assert not list((tmp_path / "x").glob("stage-*.log")) if (tmp_path / "x").exists() else True


@pytest.mark.slow
def test_serve_job_answers(smollm2, tmp_path):
    """`strata serve MODEL --port P`: the OpenAI-compatible server on the planner's stages, several users by
    default; SIGTERM ends it."""
    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(ROOT / "launcher.py"), "serve", "smollm2", "--port", str(port),
                             "--out", str(tmp_path / "out"), "--set", "max_context=512"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
