"""The kernels' A/B switches are rig keys (`kernels`, strata.config.KernelSpec): parsed and refused like the other
keys, overridden by their STRATA_* variables in config.py only, carried to a stage in its job, and handed to the
model and kernels as arguments (no module global read at import)."""
from __future__ import annotations

import ast
from dataclasses import asdict, fields
from pathlib import Path

import pytest

from strata.config import ENV_KERNELS, ConfigError, KernelSpec, cache_dir, from_dict, load

ROOT = Path(__file__).resolve().parents[1]


def strata_names(source: str) -> set[str]:
    """The STRATA_* variable names a module's code spells (docstrings aside): what it could read from the
    environment, whichever way it reaches os.environ."""
    tree = ast.parse(source)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            out |= {w.strip("'\"=:,.()") for w in n.value.split() if w.startswith("STRATA_")}
    return {w.split("=")[0] for w in out}


def test_the_scan_sees_a_read():
    """The checker finds a read however it is spelled (else the test below passes vacuously); docstrings and
    comments are prose."""
    assert strata_names('import os\nMODE = os.environ.get("STRATA_X", "auto")\n') == {"STRATA_X"}
    assert strata_names('import os\nk = "STRATA_Y"\nv = os.environ[k]\n') == {"STRATA_Y"}
    assert strata_names('"""STRATA_Z is documented here."""\n# STRATA_W\n') == set()


def test_strata_variables_are_read_in_config_only():
    """Every STRATA_* variable in strata/, workers/, launcher.py and bench/ is spelled in config.py only (which
    overrides the rig with it, or for STRATA_CACHE_DIR gives the host's path), and each switch config.py knows is
    one of its overrides."""
    found = {}
    paths = [p for pkg in ("strata", "workers", "bench") for p in (ROOT / pkg).rglob("*.py")] + [ROOT / "launcher.py"]
    for path in sorted(paths):
        if path == ROOT / "strata" / "config.py":
            continue
        for name in strata_names(path.read_text()):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not found, f"STRATA_* read outside strata/config.py (make it a rig key with an override there): {found}"
    spelled = strata_names((ROOT / "strata" / "config.py").read_text())
    assert set(ENV_KERNELS) <= spelled
    assert {"STRATA_PF_DEPTH", "STRATA_PREFILL_TIMING", "STRATA_CUDA_ATTENTION", "STRATA_CACHE_DIR"} <= spelled


def test_cache_dir_from_environment(tmp_path):
    """The C decoder's cache: STRATA_CACHE_DIR, else $XDG_CACHE_HOME/strata, else ~/.cache/strata."""
    assert cache_dir({"STRATA_CACHE_DIR": str(tmp_path / "c"), "XDG_CACHE_HOME": "/x"}) == tmp_path / "c"
    assert cache_dir({"STRATA_CACHE_DIR": "", "XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "strata"
    assert cache_dir({}) == Path.home() / ".cache" / "strata"


def test_kernels_parse_refuse_and_default():
    assert from_dict({}, env={}).kernels == KernelSpec()
    k = from_dict({"kernels": {"prefill": "torch", "decode_bells": True, "decode_ahead": False,
                               "gemv_iq3s": "float"}}, env={}).kernels
    assert (k.prefill, k.decode_bells, k.decode_ahead, k.gemv_iq3s, k.gemv_q6k) == ("torch", True, False, "float",
                                                                                   "dp4a")
    for raw, msg in (({"prefil": "torch"}, "unknown key in kernels: 'prefil' (did you mean 'prefill'?)"),
                     ({"gemv_q6k": "dp4"}, "kernels.gemv_q6k: 'dp4' is not one of bytes, words, dp4a"),
                     ({"decode_bells": "yes"}, "kernels.decode_bells: expected auto or true or false, got 'yes'"),
                     ({"decode_ahead": True}, "kernels.decode_ahead: expected auto or false, got True"),
                     ({"graph_kernels": 1}, "kernels.graph_kernels: expected a string, got 1")):
        with pytest.raises(ConfigError) as e:
            from_dict({"kernels": raw}, env={})
        assert str(e.value) == msg


def test_environment_overrides_the_rig_and_set_overrides_both(tmp_path):
    """Each STRATA_* switch overrides its `kernels` key (its values as the README writes them), a bad value is
    refused naming the key, and --set overrides the environment."""
    rig = tmp_path / "rig.yaml"
    rig.write_text("kernels: {gemv_kquant: words, decode_bells: true}\n")
    env = {"STRATA_GEMV_KQUANT": "bytes", "STRATA_DECODE_BELLS": "0", "STRATA_DECODE_AHEAD": "0",
           "STRATA_CUDA_KERNELS": "torch", "STRATA_GRAPH_ATTENTION": "masked", "STRATA_GRAPH_KERNELS": "torch",
           "STRATA_DECODE_GEMV": "cublas", "STRATA_GEMV_IQ3S": "dp4a-smem", "STRATA_GEMV_Q6K": "words",
           "STRATA_GEMV_Q8_0": "bytes", "STRATA_GEMV_MXFP4": "float", "STRATA_WINDOW_ATTENTION": "band",
           "STRATA_Q8_ATTENTION": "int8", "STRATA_GEMV_ROWS": "dp4a", "STRATA_SLOT_SPIN": "0"}
    assert set(env) == set(ENV_KERNELS)
    k = load(rig, env=env).kernels
    assert asdict(k) == {"prefill": "torch", "graph_attention": "masked", "graph_kernels": "torch",
                         "decode_gemv": "cublas", "gemv_iq3s": "dp4a-smem", "gemv_kquant": "bytes", "gemv_q6k": "words",
                         "gemv_q8_0": "bytes", "gemv_mxfp4": "float", "gemv_rows": "dp4a", "q8_attention": "int8", "window_attention": "band",
                         "decode_bells": False,
                         "decode_ahead": False, "slot_spin": False}
    assert load(rig, ["kernels.gemv_kquant=dp4a"], env=env).kernels.gemv_kquant == "dp4a"
    assert from_dict({}, env={"STRATA_DECODE_BELLS": "1"}).kernels.decode_bells is True
    with pytest.raises(ConfigError, match=r"STRATA_GEMV_Q6K='fast': expected one of bytes, words, dp4a \(it overrides "
                                          r"kernels.gemv_q6k\)"):
        from_dict({}, env={"STRATA_GEMV_Q6K": "fast"})


def test_window_attention_key():
    """kernels.window_attention: flex by default, band its A/B arm (and the fallback); anything else refused in one
    line; STRATA_WINDOW_ATTENTION overrides it; a Transformer hands it to every attention layer."""
    from strata.models.args import PRESETS
    from strata.models.model import Attention, Transformer
    assert KernelSpec().window_attention == "flex" and from_dict({}, env={}).kernels.window_attention == "flex"
    assert from_dict({"kernels": {"window_attention": "band"}}, env={}).kernels.window_attention == "band"
    assert from_dict({}, env={"STRATA_WINDOW_ATTENTION": "band"}).kernels.window_attention == "band"
    for raw, msg in (("dense", "kernels.window_attention: 'dense' is not one of flex, band"),
                     (True, "kernels.window_attention: expected a string, got True")):
        with pytest.raises(ConfigError) as e:
            from_dict({"kernels": {"window_attention": raw}}, env={})
        assert str(e.value) == msg
    with pytest.raises(ConfigError, match=r"^STRATA_WINDOW_ATTENTION='sdpa': expected one of flex, band \(it "
                                          r"overrides kernels.window_attention\)$"):
        from_dict({}, env={"STRATA_WINDOW_ATTENTION": "sdpa"})
    m = Transformer(PRESETS["smoke"], kernels=KernelSpec(window_attention="band"))
    attn = [b.attn for b in m.layers.values() if isinstance(b.attn, Attention)]
    assert attn and all(a.window_kernel == "band" for a in attn)
    m.set_kernels(KernelSpec())
    assert all(a.window_kernel == "flex" for a in attn)


def _job(**over):
    from strata.comm import messages as M
    net = M.StageNet(host="box2", remote=True, bind="", tcp_in=True, tcp_out=True, tcp_inbox=True, public="p",
                     secret="s", head_public="h", allow=[], head_tcp="tcp://10.0.0.5:5555", heartbeat_s=1.0,
                     heartbeat_timeout_s=10.0, head_clock=0.0, boot_id="b")
    job = dict(index=1, n_stages=2, device="cpu", dtype="float32", attention="flash", weights="auto", kv_dtype="auto",
               memory=None, threads=1, cores=[], start=4, end=8, model="synthetic:smoke", args={"dim": 128}, seed=0,
               max_len=512, tokens=64, max_chunk=64, prefix_block=16384, dynamic_chunks=False, depth=1, max_seqs=1, kv_pool=0,
               decode_batch="rows",
               prefix_device_bytes=0,
               perplexity=True,
               segments={}, endpoints=[], head_endpoint="", log_file="", console=False, dump_residual="",
               decode_weights="none", cuda_graphs=True, decode_ahead=False,
               kernels=asdict(KernelSpec(prefill="torch", gemv_iq3s="float", decode_bells=False)),
               debug={f: None for f in ("delay_s", "delay_step_s", "fail_stage", "fail_chunk", "fail_mode",
                                        "fail_phase", "memory_trace")}, net=net)
    job.update(over)
    return M.StageJob(**job)


def test_a_remote_stage_gets_the_heads_kernels():
    """The job carries the head's KernelSpec: a remote stage decodes it from the frame, whatever its own host's
    environment says; a job whose kernels are not KernelSpec's is refused as a bad message."""
    from strata.comm import messages as M
    from strata.config import kernel_spec
    job = M.decode_spec(M.encode_spec(_job()))
    assert kernel_spec(job.kernels) == KernelSpec(prefill="torch", gemv_iq3s="float", decode_bells=False)
    bad = asdict(KernelSpec())
    for kernels, msg in (({**bad, "gemv_q6k": "fast"}, "spec.kernels.gemv_q6k: 'fast' is not one of"),
                         ({k: v for k, v in bad.items() if k != "prefill"}, "spec.kernels: fields"),
                         ({**bad, "decode_bells": 1}, "spec.kernels.decode_bells: expected auto or true or false")):
        with pytest.raises(M.BadMessage, match=msg):
            M.encode_spec(_job(kernels=kernels))


def test_the_model_takes_its_kernels_as_arguments():
    """Transformer(kernels=, attention=) sets every layer's paths; set_kernels changes them; the resident products'
    GemvKernels is the slice's own, and a fallback on it is forgotten when the rig's choices are set again."""
    from strata.models.args import PRESETS
    from strata.kernels.attention import CUDA_ATTENTION_DEFAULT
    from strata.models.model import Attention, FeedForward, Transformer
    m = Transformer(PRESETS["smoke"])
    assert m.cuda_attention == CUDA_ATTENTION_DEFAULT and m.kernels == KernelSpec()
    m = Transformer(PRESETS["smoke"], kernels=KernelSpec(prefill="torch", gemv_q6k="bytes"), attention="flash")
    attn = [b.attn for b in m.layers.values() if isinstance(b.attn, Attention)]
    mlps = [b.mlp for b in m.layers.values() if isinstance(b.mlp, FeedForward)]
    assert attn and mlps and all(a.cuda_attention == "flash" and not a.fused for a in attn)
    assert not any(f.fused for f in mlps)
    g = m.gemv
    assert (g.iq3s, g.kquant, g.q6k) == ("dp4a-u16", "dp4a", "bytes")
    g.kquant, g.q8_0, g.mxfp4 = "words", "bytes", "float"  # what failed dp4a launches leave on it
    m.set_kernels(KernelSpec())
    assert m.gemv is g and (g.kquant, g.q6k, g.q8_0, g.mxfp4) == ("dp4a",) * 4 and all(a.fused for a in attn)
    assert all(a.cuda_attention == CUDA_ATTENTION_DEFAULT for a in attn)


def test_decode_switches_are_arguments():
    """The head decides bells and launch-ahead from the rig's values, the graphs' attention from the slice's."""
    from strata.comm import bells
    from strata.models.args import PRESETS
    from strata.decode.graphs import covers
    local = ["cpu", "cpu"]
    assert not bells.wanted(local, False) and not bells.wanted(local, False, False)
    assert bells.wanted(local, False, True) == bells.supported() and not bells.wanted(local, True, True)
    assert bells.ahead_wanted(["cuda:0", "cuda:1"]) and not bells.ahead_wanted(["cuda:0", "cuda:1"], False)
    windowed = PRESETS["gemma-3-27b"]  # window layers: the masked graphs cannot read a ring
    assert not covers(windowed, "masked")
    assert {f.name for f in fields(KernelSpec)} == {v[0] for v in ENV_KERNELS.values()}


def test_dtype_auto_is_bfloat16_on_gpus_only():
    """`dtype: auto` (the default): bfloat16 when every stage is a GPU, float32 when any is a CPU; a given dtype is
    kept; the parsed rig holds the resolved one (the planner, the stages and report.json see no "auto")."""
    from strata.config import StageSpec, auto_dtype, from_dict
    gpu, cpu = StageSpec(device="cuda:0"), StageSpec(device="cpu")
    assert auto_dtype((gpu, gpu)) == "bfloat16"
    assert auto_dtype((gpu, cpu)) == "float32" and auto_dtype((cpu,)) == "float32"
    rig = {"model": "synthetic:smoke", "stages": [{"device": "cpu"}, {"device": "cpu"}]}
    assert from_dict(rig, env={}).dtype == "float32"
    assert from_dict({**rig, "dtype": "bfloat16"}, env={}).dtype == "bfloat16"
    assert from_dict({**rig, "dtype": "auto"}, env={}).dtype == "float32"


def test_no_shipped_rig_pins_float32_on_a_gpu():
    """A rig in configs/ that may run on a GPU (a CUDA stage, or `stages: auto`) leaves `dtype` to `auto` or a
    16-bit type: copied to a GPU machine, a pinned float32 ran there at a fraction of the speed (issue 57)."""
    import yaml
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        stages = raw.get("stages", "auto")
        on_gpu = stages == "auto" or any("cuda" in str(s.get("device", "cpu") if isinstance(s, dict) else s)
                                         for s in stages)
        assert not (on_gpu and raw.get("dtype") == "float32"), f"{path.name} pins float32 on a GPU"
