"""A generation ends at any end token the model's files declare (strata.weights.checkpoint.end_ids): an HF folder's
eos_token_id lists (config.json, generation_config.json: an instruct model's end of turn is often the second or
third of them) and a GGUF's end-of-turn / end-of-message tokens, not only at the first eos id."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from families_fixtures import make_hf
from strata.weights.checkpoint import end_ids, model_args
from strata.text.sampling import SamplingParams


def _greedy(model: str, tmp_path: Path, name: str, ids: list[int], n: int):
    from strata.head.pipeline import Pipeline
    rig = dict(model=model, stages=[{"device": "cpu", "threads": 1}], chunk=16, max_context=64, progress=False,
               prompt={"random": {"tokens": 4, "seed": 0}})
    with Pipeline(rig, out=tmp_path / name, console=False) as p:
        return p.generate(np.asarray(ids), SamplingParams(max_tokens=n, temperature=0))


@pytest.mark.slow
def test_an_hf_models_second_end_token_ends_its_answer(tmp_path):
    """A tiny Llama whose greedy answer runs 8 tokens: with the 4th token named as a second end in
    generation_config.json, the pipeline and the local engine stop before it ("stop", the first 3 tokens) and say
    which end ended it."""
    pytest.importorskip("transformers")
    from strata.serve.engine import LocalEngine
    _, d = make_hf(tmp_path, "llama")
    cfg = json.loads((Path(d) / "config.json").read_text())
    vocab = cfg["vocab_size"]
    prompt = [5, 17, 42, 7, 99]
    cold = _greedy(d, tmp_path, "cold", prompt, 8)
    out = cold.continuation_ids
    assert len(out) == 8 and cold.finish_reason == "length"
    t = out[3]
    assert t not in out[:3], out  # (the random model's answer: a token not seen before its 4th place)
    eos = next(i for i in range(vocab - 1, 0, -1) if i not in out)
    cfg["eos_token_id"] = eos
    (Path(d) / "config.json").write_text(json.dumps(cfg))
    (Path(d) / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, t]}))
    assert end_ids(d, model_args(d)) == {eos, t}
    r = _greedy(d, tmp_path, "ends", prompt, 8)
    assert (r.continuation_ids, r.finish_reason, r.end_token) == (out[:3], "stop", t)
    eng = LocalEngine(d, max_context=64)
    made: list[int] = []
    stats = eng.generate(prompt, SamplingParams(max_tokens=8, temperature=0), lambda tok: made.append(tok) or True)
    assert (made, stats.finish_reason, stats.end_token) == (out[:3], "stop", t)


def test_a_config_list_and_a_gguf_end_of_turn_are_ends(tmp_path):
    """config.json's eos_token_id list counts whole (ids outside the vocabulary are dropped); a GGUF's eot and eom
    token ids join its eos; a synthetic model has its eos alone."""
    pytest.importorskip("transformers")
    _, d = make_hf(tmp_path, "llama")
    cfg = json.loads((Path(d) / "config.json").read_text())
    cfg["eos_token_id"] = [3, 9, 10 ** 9]
    (Path(d) / "config.json").write_text(json.dumps(cfg))
    (Path(d) / "generation_config.json").unlink(missing_ok=True)  # (transformers wrote its own eos there)
    args = model_args(d)
    assert args.eos_id == 3 and end_ids(d, args) == {3, 9}
    path = _gguf_with(tmp_path / "ends.gguf", [], eos_token_id=2, eot_token_id=106, eom_token_id=107)
    from dataclasses import replace
    assert end_ids(path, replace(args, eos_id=2, vocab_size=256)) == {2, 106, 107}
    smoke = model_args("synthetic:smoke")
    assert end_ids("synthetic:smoke", smoke) == ({smoke.eos_id} if smoke.eos_id is not None else set())


def _gguf_with(path: Path, tokens: list[str], **keys) -> str:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in keys.items():
        w.add_uint32(f"tokenizer.ggml.{k}", v)
    if tokens:
        w.add_token_list(tokens)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_a_gguf_ends_where_llamacpp_ends(tmp_path):
    """A GGUF's ends are llama.cpp's end-of-generation set: besides its keys, the tokens with an end text (a Gemma 3
    instruct file declares <eos> only; its <end_of_turn> ends by its text), and its fill-in-the-middle tokens;
    in a harmony vocabulary <|end|> is no end; beside <|tool_response>, </s> is an ordinary token."""
    from dataclasses import replace
    args = replace(model_args("synthetic:smoke"), vocab_size=16)
    gemma = ["<pad>", "<eos>", "<bos>", "a", "b", "<end_of_turn>", "<start_of_turn>", "c"]
    g = _gguf_with(tmp_path / "gemma.gguf", gemma, eos_token_id=1)
    assert end_ids(g, replace(args, eos_id=1)) == {1, 5}
    qwen = ["x", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
            "<PAD>"]
    q = _gguf_with(tmp_path / "qwen.gguf", qwen, eos_token_id=3)
    assert end_ids(q, replace(args, eos_id=3)) == {1, 3, 4, 5, 6}  # <PAD>: the first fim_pad text is taken
    q2 = _gguf_with(tmp_path / "qwen2.gguf", qwen, eos_token_id=3, fim_pad_token_id=7)
    assert end_ids(q2, replace(args, eos_id=3)) == {1, 3, 5, 6, 7}  # the key's fim_pad, not the text's
    harmony = ["<|start|>", "<|end|>", "<|message|>", "<|return|>", "<|call|>", "<|endoftext|>", "y"]
    h = _gguf_with(tmp_path / "oss.gguf", harmony, eos_token_id=3, eot_token_id=1)
    assert end_ids(h, replace(args, eos_id=3)) == {3, 4, 5}  # <|end|> out even as the eot key
    phi = ["<|end|>", "<|endoftext|>", "z"]
    f = _gguf_with(tmp_path / "phi.gguf", phi, eos_token_id=1)
    assert end_ids(f, replace(args, eos_id=1)) == {0, 1}  # no harmony: <|end|> ends
    s = _gguf_with(tmp_path / "s.gguf", ["<s>", "</s>", "<|tool_response>", "w"], eos_token_id=3)
    assert end_ids(s, replace(args, eos_id=3)) == {2, 3}
    s2 = _gguf_with(tmp_path / "s2.gguf", ["<s>", "</s>", "w"], eos_token_id=2)
    assert end_ids(s2, replace(args, eos_id=2)) == {1, 2}
    # the token list's ids past the model's vocabulary are dropped, as a key's are
    assert end_ids(g, replace(args, eos_id=1, vocab_size=4)) == {1}


def test_smollm2s_ends_are_llamacpps(tmp_path):
    """SmolLM2's GGUF: the end set is the one llama.cpp itself prints ("printing all EOG tokens") when it loads the
    file (its CPU build, ../shared/tools/llamacpp-peer.sh cpu; skipped where it is not built)."""
    import re
    import subprocess
    from strata.weights.checkpoint import smollm2_path
    exe = Path(__file__).resolve().parents[1] / ".peer" / "cpu" / "bin" / "llama-perplexity"
    if not exe.exists():
        pytest.skip("llama.cpp's CPU build is not here (../shared/tools/llamacpp-peer.sh cpu)")
    try:
        m = str(smollm2_path())
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    (tmp_path / "t.txt").write_text("hello world, this is a test of the end tokens")
    out = subprocess.run([str(exe), "-m", m, "-f", str(tmp_path / "t.txt"), "-c", "8", "-t", "1", "-v"],
                         capture_output=True, text=True, timeout=300).stderr
    block = out.split("printing all EOG tokens:", 1)[1].split("special tokens cache", 1)[0]
    theirs = {int(i) for i in re.findall(r"- (\d+) \(", block)}
    assert theirs and end_ids(m, model_args(m)) == theirs, theirs
