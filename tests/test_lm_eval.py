"""EleutherAI's lm-evaluation-harness against the server: its `local-completions` loglikelihood of a small
multiple-choice task (local YAML + JSONL, no hub) gives the choices and log-likelihoods of the CLI's scoring.

lm-eval is not a test dependency (it and what it needs take ~0.9 GB). The test runs lm-eval's CLI in a subprocess:
the one named by STRATA_LM_EVAL (e.g. a separate venv's bin/lm-eval, installed with `pip install "lm-eval[api]"
transformers`), else `python -m lm_eval` when lm_eval is importable here; otherwise it is skipped."""
from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_server import PIPE_RIG, smollm2_server  # noqa: F401  (the fixture: a LocalEngine on SmolLM2, served)


def _lm_eval_command() -> list[str] | None:
    path = os.environ.get("STRATA_LM_EVAL")
    if path:
        return [path]  # a missing file fails the test, naming it: it was asked for
    if importlib.util.find_spec("lm_eval") is not None:
        return [sys.executable, "-m", "lm_eval"]
    return None


LM_EVAL = _lm_eval_command()
pytestmark = pytest.mark.skipif(LM_EVAL is None, reason="lm_eval is not importable and STRATA_LM_EVAL (the path of "
                                "an lm-eval CLI, e.g. another venv's bin/lm-eval) is not set")

# SmolLM2-135M-Instruct in its chat format, one word asked. lm-eval sends max_tokens 1 and drops the last logprob,
# the generated token's: after an answer with its full stop the greedy next token is the end of sequence
# (<|im_end|>), after one without it is not; both are here.
CONTEXT = "<|im_start|>user\n{q} Answer in one word.<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [
    ("What is the capital of France?", ["Paris.", "Berlin.", "Madrid."], 0),
    ("How many legs does a spider have?", ["Six", "Eight"], 1),
    ("Which planet is known as the Red Planet?", ["Venus.", "Mars.", "Jupiter.", "Saturn."], 1),
    ("What color is the sky on a clear day?", ["Green", "Blue", "Red"], 1),
    ("What do bees make?", ["Honey.", "Milk.", "Silk."], 0),
    ("What is frozen water called?", ["Steam", "Ice"], 1),
    ("Which animal barks?", ["Cat.", "Dog.", "Cow."], 1),
    ("What is the opposite of hot?", ["Cold", "Warm", "Loud", "Tall"], 0),
]


def _write_task(root: Path) -> Path:
    """The task as lm-eval reads it: tasks/strata_mc.yaml over data.jsonl (datasets' json builder, local file)."""
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    tasks = root / "tasks"
    tasks.mkdir()
    context = json.dumps(CONTEXT.replace("{q}", "{{question}}"))  # a YAML double-quoted string is JSON's
    (tasks / "strata_mc.yaml").write_text(f"""task: strata_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
test_split: test
output_type: multiple_choice
doc_to_text: {context}
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""")
    return tasks


def _run_lm_eval(url: str, tokenizer_dir: Path, root: Path) -> list[dict]:
    """lm-eval's CLI: local-completions on `url`, token ids from the HF tokenizer in tokenizer_dir (lm-eval needs
    one to know where each continuation starts) -> its per-document samples (--log_samples)."""
    tasks, out = _write_task(root), root / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(root / "hf"),
           "TOKENIZERS_PARALLELISM": "false"}
    args = ["run", "--model", "local-completions", "--model_args",
            f"model=smollm2,base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={tokenizer_dir},"
            "tokenized_requests=True,max_length=512,max_retries=1",
            "--tasks", "strata_mc", "--include_path", str(tasks), "--output_path", str(out), "--log_samples"]
    r = subprocess.run(LM_EVAL + args, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"lm-eval exited {r.returncode}:\n{r.stderr[-4000:]}\n{r.stdout[-2000:]}"
    found = glob.glob(str(out / "**" / "samples_strata_mc_*.jsonl"), recursive=True)
    assert len(found) == 1, (found, r.stdout[-2000:])
    return sorted((json.loads(line) for line in Path(found[0]).read_text().splitlines()), key=lambda s: s["doc_id"])


def _split(tok, context: str, continuation: str) -> tuple[list[int], int]:
    """(the ids of context + continuation, the context's length in them), by lm-eval's rule (its TemplateLM
    ._encode_pair): the context's trailing whitespace goes to the continuation, the whole is encoded once and cut
    after as many ids as the context alone encodes to."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    return tok(context + continuation), len(tok(context))


def test_lm_eval_local_completions_loglikelihood_gives_the_cli_scores(smollm2_server, tmp_path):
    transformers = pytest.importorskip("transformers")  # the HF tokenizer folder lm-eval loads is saved with it
    from families_fixtures import smollm2_tokenizer_dir
    from strata.head.pipeline import Pipeline
    s, eng = smollm2_server
    tokenizer_dir = smollm2_tokenizer_dir()
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))

    samples = _run_lm_eval(s.url, tokenizer_dir, tmp_path)

    # the CLI's scoring (Pipeline.score: a fresh two-stage pipeline, the last stage's head rows) of the same ids
    rig = {k: v for k, v in PIPE_RIG.items() if k != "debug"}
    ended_at_eos = 0
    with Pipeline({**rig, "prompt": {"text": "x"}}, out=tmp_path / "cli", console=False) as p:
        eos = p.plan.args.eos_id
        assert len(samples) == len(QUESTIONS)
        for sample, (q, choices, answer) in zip(samples, QUESTIONS):
            context = CONTEXT.format(q=q)
            want = []
            for choice in choices:
                ids, ctxlen = _split(eng.tokenize, context, choice)
                # lm-eval sent the HF tokenizer's ids: they are Strata's (else the values below could not agree)
                assert (ids, ctxlen) == _split(lambda t: hf(t, add_special_tokens=False).input_ids, context, choice)
                lp, top, _ = p.score(ids + [eos], start=ctxlen, top=1)  # and the row after the whole answer
                want.append(float(lp[:-1].astype("float64").sum()))
                ended_at_eos += int(top[-1, 0]) == eos
            got = [float(r[0]) for r in sample["filtered_resps"]]
            assert sample["doc"]["question"] == q and len(got) == len(choices)
            assert got == pytest.approx(want, abs=1e-3), (q, choices)
            pick = max(range(len(want)), key=want.__getitem__)
            assert max(range(len(got)), key=got.__getitem__) == pick, (q, got, want)
            assert sample["acc"] == float(pick == answer)  # lm-eval's own verdict: its choice is the CLI's
            assert all(math.isfinite(g) and g < 0 for g in got)
    # both cases of lm-eval's dropped last logprob: a generated token's, and EOS's (the answer ended there)
    assert 0 < ended_at_eos < sum(len(c) for _, c, _ in QUESTIONS), ended_at_eos
