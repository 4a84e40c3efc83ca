"""Split GGUF models (llama.cpp's gguf-split: NAME-00001-of-0000N.gguf) read as one model from the first part's path:
SmolLM2 split three ways computes the unsplit file's logits bit for bit, and every inconsistent set of parts is
refused in one line naming the file, before anything loads."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from strata.errors import ModelError
from strata.kvcache.kv_file import model_identity
from strata.text.chat import ChatTemplate
from strata.text.tokenizer import Tokenizer
from strata.weights import checkpoint
from strata.weights.gguf_fast import GGUFIndex
from strata.weights.gguf_files import field_value, is_part_name, open_model
from strata.weights.gguf_loader import gguf_slice_tensors, tensor_facts

ROOT = Path(__file__).resolve().parents[1]
# SmolLM2's 272 tensors in 3 parts. The file lists its layers in text order (0, 1, 10..19, 2, 20..29, 3..9): part 1
# holds layers 0, 1, 10-17 and half of 18, part 2 the rest of 18, 19, 2, 20-27, part 3 28, 29, 3-9
PER_PART = 95
STAGES = [(0, 7), (7, 19), (19, 30)]  # every stage reads from two or three parts


def split_gguf(src: Path, out: Path, per_part: int, keys: dict | None = None, also: dict | None = None,
               no_tensor_first: bool = False) -> list[Path]:
    """`src` rewritten as `gguf-split --split-max-tensors per_part [--no-tensor-first-split]` writes it: the model's
    metadata in the first part alone, then split.no / split.count / split.tensors.count in every part (u16, u16,
    i32), each part its tensors in the source's order. For the refusals: `keys` {part index: {split key: value}}
    overrides a part's split keys, `also` {part index: [tensor name]} writes another part's tensor into that part."""
    r = gguf.GGUFReader(src)
    tensors = list(r.tensors)
    groups = [[]] * no_tensor_first + [tensors[i:i + per_part] for i in range(0, len(tensors), per_part)]
    by_name = {t.name: t for t in tensors}
    stem = src.name.removesuffix(".gguf")
    paths = [out / f"{stem}-{i + 1:05d}-of-{len(groups):05d}.gguf" for i in range(len(groups))]
    arch = field_value(r, "general.architecture")
    for i, (path, group) in enumerate(zip(paths, groups)):
        w = gguf.GGUFWriter(str(path), arch)
        w.kv_data[0].clear()  # (the writer's own general.architecture: the first part copies the source's keys)
        if i == 0:
            for f in r.fields.values():
                if f.name.startswith("GGUF."):  # the header's counts, which gguf-py lists as fields
                    continue
                if f.name == "general.alignment":
                    w.add_custom_alignment(int(f.contents()))
                    continue
                sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
                w.add_key_value(f.name, f.contents(), f.types[0], sub)
        split = {"split.no": i, "split.count": len(groups), "split.tensors.count": len(tensors)}
        split.update((keys or {}).get(i, {}))
        w.add_uint16("split.no", split["split.no"])
        w.add_uint16("split.count", split["split.count"])
        w.add_int32("split.tensors.count", split["split.tensors.count"])
        for t in group + [by_name[n] for n in (also or {}).get(i, [])]:
            data = np.array(t.data)
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type if data.dtype == np.uint8 else None)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return paths


# -- SmolLM2, split three ways -------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    try:
        return checkpoint.smollm2_path()
    except ModelError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def parts(smol, tmp_path_factory):
    return split_gguf(smol, tmp_path_factory.mktemp("split"), PER_PART)


def test_the_parts_are_gguf_splits(smol, parts):
    """Three parts named as llama_split_path names them, the metadata in the first alone, every tensor once."""
    assert [p.name for p in parts] == [f"SmolLM2-135M-Instruct.Q4_1-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    whole = gguf.GGUFReader(smol)
    readers = [gguf.GGUFReader(p) for p in parts]
    assert [len(r.tensors) for r in readers] == [95, 95, 82]
    assert {k for k in readers[1].fields if not k.startswith("GGUF.")} == {"split.no", "split.count",
                                                                             "split.tensors.count"}
    assert [field_value(r, "split.no") for r in readers] == [0, 1, 2]
    assert all(field_value(r, "split.tensors.count") == len(whole.tensors) for r in readers)
    assert field_value(readers[0], "tokenizer.ggml.tokens") == field_value(whole, "tokenizer.ggml.tokens")
    names = {t.name for t in readers[1].tensors}
    assert "blk.18.attn_norm.weight" not in names and "blk.18.attn_q.weight" in names  # layer 18 straddles


def test_fast_index_reads_each_part_as_gguf_py(parts):
    for p in parts:
        ours, ref = GGUFIndex(p), gguf.GGUFReader(p)
        assert list(ours.values) == list(ref.fields)
        assert all(ours.value(k) == field_value(ref, k) for k in ref.fields)
        assert [(t.name, t.data_offset, t.n_bytes) for t in ours.tensors] == \
            [(t.name, t.data_offset, t.n_bytes) for t in ref.tensors]


def test_model_is_read_as_one(smol, parts):
    """Args, tensor facts, end ids, tokenizer, chat template and file checks from the first part's path."""
    spec, args = str(parts[0]), checkpoint.model_args("smollm2")
    assert checkpoint.resolve(spec) == ("gguf", spec)
    assert checkpoint.model_args(spec) == args
    model = open_model(parts[0])
    assert model.parts == tuple(parts) and len(model.tensors) == 272
    assert [model.file_of(f"blk.{i}.attn_q.weight") for i in (0, 18, 2, 3)] == [parts[0], parts[1], parts[1], parts[2]]
    ours, whole = tensor_facts(parts[0]), tensor_facts(smol)
    assert set(ours) == set(whole)
    for n, f in ours.items():
        assert (f.qtype, f.shape) == (whole[n].qtype, whole[n].shape) and f.stored >= f.needed(), n
    checkpoint.check_model_files(spec)
    assert checkpoint.has_quantized(spec, args)
    assert checkpoint.end_ids(spec, args) == checkpoint.end_ids("smollm2", args)
    text = "<|im_start|>user\nThe capital of France is?<|im_end|>\n"
    assert Tokenizer.for_model(spec).encode(text) == Tokenizer.for_model("smollm2").encode(text)
    assert ChatTemplate.for_model(spec) == ChatTemplate.for_model("smollm2")
    assert checkpoint.stage_bytes(spec, args, 7, 19, torch.float32, "resident", device_type="cuda") == \
        checkpoint.stage_bytes("smollm2", args, 7, 19, torch.float32, "resident", device_type="cuda")
    ident = model_identity(spec, 0)
    assert ident.startswith("gguf ") and all(p.name in ident for p in parts)  # a KV file names every part


@pytest.mark.parametrize("resident", [False, True])
def test_slices_equal_the_unsplit_files(smol, parts, resident):
    """Each stage's tensors (dequantized, or as stored blocks) are the unsplit file's, bit for bit."""
    args = checkpoint.model_args("smollm2")
    for a, b in STAGES:
        ours = gguf_slice_tensors(parts[0], args, a, b, resident=resident)
        theirs = gguf_slice_tensors(smol, args, a, b, resident=resident)
        assert list(ours) == list(theirs)
        for n, t in ours.items():
            u = theirs[n]
            assert type(t) is type(u), n
            if resident and not isinstance(t, torch.Tensor):
                assert (t.qtype, t.cols) == (u.qtype, u.cols) and torch.equal(t.blocks, u.blocks), n
            else:
                assert torch.equal(t, u), n


def test_three_stages_of_the_split_give_the_unsplit_logits(parts):
    """A prompt through three stages loaded from the split copy as a stage process loads them (load_stage): the
    logits the unsplit file gives in one."""
    spec, args = str(parts[0]), checkpoint.model_args("smollm2")
    ids = torch.tensor([Tokenizer.for_model(spec).encode("The capital of France is Paris, and the capital of Italy "
                                                         "is")])

    def stage(model, a, b):
        return checkpoint.load_stage(model, args, a, b, device="cpu", dtype=torch.float32, max_len=ids.shape[1])
    whole = stage("smollm2", 0, args.n_layers)
    want = whole.logits(whole.forward(ids, 0))
    del whole
    x = ids
    for a, b in STAGES:
        s = stage(spec, a, b)
        x = s.forward(x, 0)
    assert torch.equal(s.logits(x), want)


# -- refusals, on a tiny file --------------------------------------------------------------------
def _tiny(path: Path, **split) -> Path:
    w = gguf.GGUFWriter(str(path), "llama", **split)
    w.add_uint32("llama.block_count", 1)
    w.add_array("tokenizer.ggml.tokens", ["a", "b"])
    rng = np.random.default_rng(0)
    for n in ("token_embd.weight", "blk.0.attn_norm.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
              "blk.0.ffn_up.weight", "output_norm.weight"):
        w.add_tensor(n, rng.standard_normal((4, 8) if n.endswith("_q.weight") else (8,), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _refused(path: Path, match: str, names: Path) -> None:
    """Refused in one line naming `names`, wherever the model is read from that path (resolving the spec too, where
    its name is gguf-split's: a single file is not opened there)."""
    reads = [checkpoint.model_args, lambda p: Tokenizer.from_gguf(Path(p)), lambda p: tensor_facts(Path(p))]
    for read in reads + ([checkpoint.resolve] if is_part_name(path.name) else []):
        with pytest.raises(ModelError, match=match) as e:
            read(str(path))
        assert "\n" not in str(e.value) and str(names) in str(e.value)


@pytest.fixture
def tiny(tmp_path):
    (tmp_path / "src").mkdir()
    return _tiny(tmp_path / "src" / "m.gguf")


def test_tiny_split_reads_as_its_source(tiny, tmp_path):
    parts = split_gguf(tiny, tmp_path, 2)
    m, whole = open_model(parts[0]), open_model(tiny)
    assert m.parts == tuple(parts) and m.part_of == {n: i // 2 for i, n in enumerate(whole.tensors)}
    for n, t in whole.tensors.items():
        assert np.array_equal(m.tensors[n].data, t.data), n
    assert m.value("tokenizer.ggml.tokens") == ["a", "b"] and m.value("split.count") == 3


def test_gguf_pys_own_split_reads_as_one(tiny, tmp_path):
    """gguf-py's writer splits too (convert_hf_to_gguf.py --split-max-tensors): an independent writer of the format."""
    _tiny(tmp_path / "w.gguf", split_max_tensors=4)
    first = tmp_path / "w-00001-of-00002.gguf"
    m = open_model(first)
    assert m.parts == (first, tmp_path / "w-00002-of-00002.gguf") and m.value("split.count") == 2
    whole = open_model(tiny)
    assert list(m.tensors) == list(whole.tensors)
    assert all(np.array_equal(m.tensors[n].data, t.data) for n, t in whole.tensors.items())


def test_metadata_only_first_part(tiny, tmp_path):
    """gguf-split --no-tensor-first-split: the first part holds the metadata and no tensor."""
    parts = split_gguf(tiny, tmp_path, 3, no_tensor_first=True)
    m = open_model(parts[0])
    assert len(parts) == 3 and not gguf.GGUFReader(parts[0]).tensors
    assert list(m.tensors) == list(open_model(tiny).tensors) and set(m.part_of.values()) == {1, 2}
    assert set(tensor_facts(parts[0])) == set(m.tensors)


def test_one_part_is_a_single_file(tiny, tmp_path):
    """gguf-split's one-part output (split.count 1) and a file whose name looks split but whose keys are not."""
    (one,) = split_gguf(tiny, tmp_path, 10)
    assert one.name == "m-00001-of-00001.gguf" and open_model(one).parts == (one,)
    looks = tmp_path / "x-00002-of-00003.gguf"
    shutil.copy(tiny, looks)
    assert open_model(looks).parts == (looks,) and checkpoint.resolve(str(looks)) == ("gguf", str(looks))


def test_later_part_refused_naming_the_first(tiny, tmp_path):
    parts = split_gguf(tiny, tmp_path, 2)
    _refused(parts[1], r"part 2 of 3 of a split GGUF; name its first part, m-00001-of-00003\.gguf", parts[1])


def test_missing_part_refused(tiny, tmp_path):
    parts = split_gguf(tiny, tmp_path, 2)
    parts[2].unlink()
    _refused(parts[0], "missing part 3 of 3 of the split GGUF m-00001-of-00003.gguf", parts[2])


def test_first_part_unlike_its_name_refused(tiny, tmp_path):
    parts = split_gguf(tiny, tmp_path, 2)
    renamed = tmp_path / "m.gguf"
    parts[0].rename(renamed)
    _refused(renamed, "whose name does not end -00001-of-00003.gguf", renamed)
    wrong = tmp_path / "m-00001-of-00004.gguf"
    renamed.rename(wrong)
    _refused(wrong, "whose name does not end -00001-of-00003.gguf", wrong)


@pytest.mark.parametrize("part,key,value,match", [
    (2, "split.count", 4, "split.count is 4, its name and the first part m-00001-of-00003.gguf say 3"),
    (1, "split.no", 2, r"split.no is 2, its name says part 2 of 3 \(split.no 1\)"),
    (1, "split.tensors.count", 5, "split.tensors.count is 5, the first part m-00001-of-00003.gguf says 6"),
])
def test_part_keys_unlike_its_name_or_the_first_refused(tiny, tmp_path, part, key, value, match):
    parts = split_gguf(tiny, tmp_path, 2, keys={part: {key: value}})
    _refused(parts[0], match, parts[part])


def test_total_unlike_split_tensors_count_refused(tiny, tmp_path):
    parts = split_gguf(tiny, tmp_path, 2, keys={i: {"split.tensors.count": 7} for i in range(3)})
    _refused(parts[0], "split.tensors.count is 7, its 3 parts hold 6 tensors", parts[0])


def test_tensor_in_two_parts_refused(tiny, tmp_path):
    parts = split_gguf(tiny, tmp_path, 2, also={2: ["blk.0.attn_q.weight"]})
    _refused(parts[0], r"tensor blk\.0\.attn_q\.weight is also in m-00002-of-00003\.gguf", parts[2])


# -- llama.cpp's own gguf-split, where built (locally only) --------------------------------------
def test_llama_cpps_split_reads_the_same(smol, tmp_path):
    """A file split by llama.cpp's `llama-gguf-split` (its CPU build: ../shared/tools/llamacpp-peer.sh cpu; skipped
    where it is not built) reads as the unsplit file: the same args, tensors and metadata."""
    exe = ROOT / ".peer" / "cpu" / "bin" / "llama-gguf-split"
    if not exe.exists():
        pytest.skip("llama.cpp's CPU build is not here (../shared/tools/llamacpp-peer.sh cpu)")
    subprocess.run([str(exe), "--split", "--split-max-tensors", str(PER_PART), str(smol), str(tmp_path / "smol")],
                   check=True, capture_output=True, timeout=300)
    first = tmp_path / "smol-00001-of-00003.gguf"
    args = checkpoint.model_args("smollm2")
    assert checkpoint.model_args(str(first)) == args and len(open_model(first).parts) == 3
    for a, b in STAGES:
        ours, theirs = gguf_slice_tensors(first, args, a, b), gguf_slice_tensors(smol, args, a, b)
        assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    assert Tokenizer.for_model(str(first)).encode("Hello world") == Tokenizer.for_model("smollm2").encode("Hello world")
