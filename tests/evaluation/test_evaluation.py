"""Evaluation: offline tasks, the lm-eval model and the report card, against independent computations
(a plain forward pass with log_softmax, lm-eval's own `hf` backend on the model exported to transformers)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tinyformer.cli.main import main
from tinyformer.config import ModelConfig
from tinyformer.data.tokenizer import build_tokenizer
from tinyformer.evaluation.scoring import score_continuations
from tinyformer.evaluation.tasks import MultipleChoice, builtin_task, evaluate_items, mc_context
from tinyformer.models.decoder import DecoderLM
from tinyformer.run_folder import load_model, load_tokenizer, save_model

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = ("the quick brown fox jumps over the lazy dog. " * 20 + "def f(x):\n    return x * 2\n" * 10
        + "Question: which animal? Answer: the fox, the dog, a cat or a bird.\n" * 10)
QUESTIONS = [
    {"question": "Which animal is quick?", "choices": ["the fox", "a dog", "the lazy cat", "birds"], "answer": 0},
    {"question": "What does f return?", "choices": ["x * 2", "x", "nothing at all"], "answer": 0},
    {"question": "Who is lazy?", "choices": ["fox", "the dog"], "answer": 1},
    {"question": "Pick one", "choices": ["return x * 2 over the lazy dog", "the", "fox jumps"], "answer": 2},
    {"question": "Ünïcödé?", "choices": ["é", "ab", "xyz"], "answer": 2},
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny model with a BPE tokenizer, as `train` writes it; norms perturbed so that a
    mis-mapped weight shows."""
    torch.manual_seed(0)
    tok = build_tokenizer("bpe", TEXT, vocab_size=300)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64,
                      max_seq_len=64, norm_eps=1e-6, tie_embeddings=False)
    model = DecoderLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp("evaluation") / "run"
    save_model(out, model)
    tok.save(out)
    return out


def plain_logprob(model: torch.nn.Module, ctx: list[int], cont: list[int]) -> float:
    """log p(cont | ctx) from one float64 forward pass over ctx + cont and a log_softmax."""
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0].double(), dim=-1)
    return sum(float(logp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont))


def test_batched_cached_scores_equal_plain_forward_passes(run: Path) -> None:
    model, tok = load_model(run), load_tokenizer(run)
    ref = load_model(run).double()
    ctx_a, ctx_b = tok.encode("the quick brown"), tok.encode("def f(x):\n    return")
    requests = [(ctx_a, tok.encode(" fox")), (ctx_a, tok.encode(" fox jumps over")), (ctx_b, tok.encode(" x * 2")),
                (ctx_b, tok.encode(" x")), (tok.encode("the"), tok.encode(" lazy dog. the quick"))]
    for batch_size in (1, 3, 8):  # contexts of different lengths in one batch: left padding
        scores = score_continuations(model, requests, batch_size=batch_size)
        for (ctx, cont), s in zip(requests, scores):
            assert s.logprob == pytest.approx(plain_logprob(ref, ctx, cont), abs=1e-4)
            assert len(s.token_logprobs) == len(cont)


def test_multiple_choice_scores_equal_a_hand_computation(run: Path) -> None:
    model, tok = load_model(run), load_tokenizer(run)
    ref = load_model(run).double()
    items = [MultipleChoice(q["question"], tuple(q["choices"]), q["answer"]) for q in QUESTIONS]
    got = evaluate_items(model, tok, items, batch_size=3)["multiple_choice"]
    acc, acc_norm, acc_bytes = [], [], []
    for it in items:
        ctx = mc_context(it.question)
        lls = []
        for choice in it.choices:
            whole, head = tok.encode(ctx + " " + choice), tok.encode(ctx)
            assert whole[: len(head)] == head  # the context's tokens end at the boundary here
            lls.append(plain_logprob(ref, head, whole[len(head):]))
        acc.append(max(range(len(lls)), key=lambda i: lls[i]) == it.answer)
        acc_norm.append(max(range(len(lls)), key=lambda i: lls[i] / len(it.choices[i])) == it.answer)
        acc_bytes.append(max(range(len(lls)), key=lambda i: lls[i] / len(it.choices[i].encode())) == it.answer)
    n = len(items)
    assert got["n"] == n
    assert got["acc"] == pytest.approx(sum(acc) / n)
    assert got["acc_norm"] == pytest.approx(sum(acc_norm) / n)
    assert got["acc_bytes"] == pytest.approx(sum(acc_bytes) / n)
    mean = sum(acc) / n
    assert got["acc_stderr"] == pytest.approx(math.sqrt(sum((a - mean) ** 2 for a in acc) / (n - 1) / n))


def test_exact_answer_rows_score_greedy_text(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, tok = load_model(run), load_tokenizer(run)
    prompt = "the quick brown"
    ids = tok.encode(prompt)
    with torch.no_grad():  # greedy by plain argmax over full forward passes
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    greedy = tok.decode(ids[len(tok.encode(prompt)):], skip_special_tokens=True)
    stop = "\u00a7"  # never generated: the answer is the whole greedy text
    rows = [{"prompt": prompt, "answer": greedy, "stop": [stop]},
            {"prompt": prompt, "answer": greedy + " not this", "stop": [stop]}]
    task = tmp_path / "exact.jsonl"
    task.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["eval", "--model", str(run), "--task", str(task), "--max-new-tokens", "6", "--json",
                 "--no-progress"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["exact_answer"] == {"n": 2, "exact_match": 0.5, "exact_match_stderr": pytest.approx(0.5)}


def test_chat_exact_answer_rows_render_the_question_with_the_template(run: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from tinyformer.data.chat_template import render_plain

    model, tok = load_model(run), load_tokenizer(run)
    question = "which fox?"
    assert tok.chat_template is None  # so the run answers in the plain format, rendered here independently
    ids = tok.encode(render_plain([{"role": "user", "content": question}]))
    start = len(ids)
    with torch.no_grad():  # greedy by plain argmax over full forward passes, ended by EOS as generation is
        while len(ids) < start + 6:
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            if ids[-1] == tok.eos_id:
                break
    greedy = tok.decode(ids[start:], skip_special_tokens=True)
    stop = "\u00a7"
    rows = [{"prompt": question, "answer": greedy, "stop": [stop], "chat": True},
            {"prompt": question, "answer": greedy + " not this", "stop": [stop], "chat": True}]
    task = tmp_path / "chat.jsonl"
    task.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["eval", "--model", str(run), "--task", str(task), "--max-new-tokens", "6", "--json",
                 "--no-progress", "--no-report"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["exact_answer"] == {"n": 2, "exact_match": 0.5, "exact_match_stderr": pytest.approx(0.5)}


@pytest.mark.parametrize("content, message", [
    ("", "has no questions"),
    ("\n\n", "has no questions"),
    ('{"question": "q", "choices": ["a", "b"], "answer": 2}\n', ":1: \"answer\" must be the index"),
    ('{"question": "q", "choices": ["a"], "answer": 0}\n', "at least 2 non-empty strings"),
    ('{"question": "q", "choices": ["a", "b"], "answer": 0}\n{"prompt": "p"}\n', ":2: \"answer\" of an exact"),
    ('{"text": "hello"}\n', "a task row needs"),
    ("[1, 2]\n", "must be a JSON object"),
    ("{not json\n", ":1: not valid JSON"),
])
def test_malformed_task_files_are_one_line_errors(content: str, message: str, run: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    task = tmp_path / "task.jsonl"
    task.write_text(content)
    assert main(["eval", "--model", str(run), "--task", str(task), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_builtin_task_asks_which_module_defines_a_class(tmp_path: Path) -> None:
    """On a stand-in standard library: public classes defined in exactly one public module, the answer
    among four distinct modules; private modules and classes, tests and ambiguous names left out."""
    modules = {"collections/__init__.py": "class OrderedDict: pass\nclass _Hidden: pass\n",
               "json/decoder.py": "class JSONDecoder: pass\nclass Shared: pass\n",
               "json/__init__.py": "'doc'\n", "fractions.py": "class Fraction: pass\nclass Shared: pass\n",
               "_private.py": "class Secret: pass\n", "test/test_x.py": "class TestCase2: pass\n",
               "ssl.py": "class SSLSocket: pass\n", "os.py": "def f(): pass\n"}
    for rel, src in modules.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    items = builtin_task(10, stdlib_dir=tmp_path)
    assert builtin_task(10, stdlib_dir=tmp_path) == items  # deterministic
    owner = {"OrderedDict": "collections", "JSONDecoder": "json.decoder", "Fraction": "fractions", "SSLSocket": "ssl"}
    asked = {it.question: it for it in items}
    assert set(asked) == {f"Which module provides `{name}`?" for name in owner}
    for it in items:
        assert len(set(it.choices)) == 4 and set(it.choices) <= {"collections", "json.decoder", "fractions", "ssl"}
        assert it.choices[it.answer] == owner[it.question.split("`")[1]]


def test_report_card_gains_the_eval_table(run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "report.md").write_text("# Report\n\nloss 1.23\n")
    task = tmp_path / "mc.jsonl"
    task.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    for _ in range(2):  # a second run replaces its rows instead of adding more
        assert main(["eval", "--model", str(copy), "--task", str(task), "--json", "--no-progress"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    report = (copy / "report.md").read_text()
    assert report.startswith("# Report\n\nloss 1.23\n")
    rows = [line for line in report.splitlines() if line.startswith(f"| task {task} |")]
    assert [r.split(" | ")[1] for r in rows] == ["acc", "acc_norm", "acc_bytes"]
    assert f"| {result['multiple_choice']['acc']:.4f} | 5 |" in rows[0]
    assert main(["eval", "--model", str(copy), "--task", str(task), "--no-report", "--no-progress"]) == 0
    assert (copy / "report.md").read_text() == report
    # loss on text joins the same table
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog.\n" * 10)
    capsys.readouterr()
    assert main(["eval", "--model", str(copy), "--data", str(tmp_path / "t.txt"), "--json", "--no-progress"]) == 0
    text = json.loads(capsys.readouterr().out)
    lines = (copy / "report.md").read_text().splitlines()
    assert f"| text {tmp_path / 't.txt'} | loss | {text['loss']:.4f} | {text['tokens']} |" in lines
    assert set(rows) <= set(lines) and lines.count("<!-- tinyformer eval -->") == 1


def test_builtin_accuracy_lands_beside_the_loss_in_the_report_card(run: Path, tmp_path: Path) -> None:
    import shutil

    from tinyformer.evaluation.tasks import add_builtin_accuracy
    from tinyformer.report_card import merge_eval_table

    stdlib = tmp_path / "stdlib"
    for module, cls in [("alpha", "A"), ("beta", "B"), ("gamma", "C"), ("delta", "D"), ("eps", "E")]:
        stdlib.mkdir(exist_ok=True)
        (stdlib / f"{module}.py").write_text(f"class {cls}: pass\n")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    assert add_builtin_accuracy(copy, load_model(copy), load_tokenizer(copy), 5, stdlib_dir=stdlib) is None
    (copy / "report.md").write_text("# Report\n")
    merge_eval_table(copy, [("text val", "loss", 2.5, 1000)])
    add_builtin_accuracy(copy, load_model(copy), load_tokenizer(copy), 5, stdlib_dir=stdlib)
    expected = evaluate_items(load_model(copy), load_tokenizer(copy), builtin_task(5, stdlib_dir=stdlib))
    lines = (copy / "report.md").read_text().splitlines()
    assert "| text val | loss | 2.5000 | 1000 |" in lines
    assert f"| task builtin | acc | {expected['multiple_choice']['acc']:.4f} | 5 |" in lines


def test_per_token_losses_sum_to_the_loss_and_give_bits_per_byte(run: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "held_out.txt"
    data.write_text("the lazy dog jumps over the quick fox; wörld.\n" * 8, encoding="utf-8")
    assert main(["eval", "--model", str(run), "--data", str(data), "--json", "--per-token", "--no-progress"]) == 0
    result = json.loads(capsys.readouterr().out)
    losses = [t["loss"] for t in result["token_losses"]]
    assert len(losses) == result["tokens"]
    assert sum(losses) / len(losses) == pytest.approx(result["loss"], rel=1e-6)
    tok = load_tokenizer(run)
    assert all(t["bytes"] == len(tok.token_bytes(t["id"])) for t in result["token_losses"])
    n_bytes = sum(t["bytes"] for t in result["token_losses"])
    assert n_bytes == result["bytes"]
    assert result["bits_per_byte"] == pytest.approx(result["loss"] * result["tokens"] / (n_bytes * math.log(2)))


# ------------------------------------------------------------------------------------------------
# lm-eval: the tinyformer model against lm-eval's own hf backend on the exported model
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("hf") / "hf"
    assert main(["convert", "--model", str(run), "--to-hf", str(out)]) == 0
    return out


def write_mc_task(folder: Path) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS), encoding="utf-8")
    (folder / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    return folder


def instances(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_lm_eval_model_matches_the_hf_backend(run: Path, exported: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from tinyformer.evaluation.harness import TinyformerLM

    # a window of 32 of the model's 64 positions: long texts need several rolling windows
    hf = HFLM(pretrained=str(exported), batch_size=3, device="cpu", dtype="float32", max_length=32)
    ours = TinyformerLM(run=str(run), batch_size=3, max_length="32")
    assert ours.max_length == hf.max_length == 32

    # loglikelihoods: contexts of different lengths in padded batches, some cut to fit 32 tokens
    pairs = [("the quick brown", " fox"), ("def f(x):", "\n    return x * 2"), ("the", " lazy dog"),
             ("Question: which animal?" * 4, " Answer: the fox, the dog"), ("", "the quick brown fox")]
    a = ours.loglikelihood(instances("loglikelihood", pairs), disable_tqdm=True)
    b = hf.loglikelihood(instances("loglikelihood", pairs), disable_tqdm=True)
    for (lla, ga), (llb, gb) in zip(a, b):
        assert lla == pytest.approx(llb, abs=1e-4) and ga == gb
    # rolling: texts several times longer than the context
    texts = [(TEXT[:600],), ("the quick brown fox",), (TEXT[700:1200],)]
    assert len(ours.tok_encode(texts[0][0])) > 3 * 32
    ra = ours.loglikelihood_rolling(instances("loglikelihood_rolling", texts), disable_tqdm=True)
    rb = hf.loglikelihood_rolling(instances("loglikelihood_rolling", texts), disable_tqdm=True)
    assert ra == pytest.approx(rb, abs=1e-4)
    # greedy generation with stop strings
    gens = [("the quick", {"until": ["."], "max_gen_toks": 8, "do_sample": False}),
            ("def f(x):", {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False})]
    assert ours.generate_until(instances("generate_until", gens), disable_tqdm=True) == \
        hf.generate_until(instances("generate_until", gens), disable_tqdm=True)

    # a local multiple-choice task YAML with local JSONL data: same acc and acc_norm
    folder = write_mc_task(tmp_path / "tasks")
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    theirs = simple_evaluate(model=hf, tasks=["tiny_mc"], task_manager=manager, log_samples=False)["results"]["tiny_mc"]
    capsys.readouterr()
    assert main(["eval", "--model", str(run), "--harness", "tiny_mc", "--include-path", str(folder),
                 "--batch-size", "3", "--json", "--no-progress"]) == 0
    mine = json.loads(capsys.readouterr().out.splitlines()[-1])["results"]["tiny_mc"]
    assert mine["acc,none"] == theirs["acc,none"] and mine["acc_norm,none"] == theirs["acc_norm,none"]
    # and the offline --task path scores the same questions the same way
    items = [MultipleChoice(q["question"], tuple(q["choices"]), q["answer"]) for q in QUESTIONS]
    offline = evaluate_items(load_model(run), load_tokenizer(run), items, batch_size=3)["multiple_choice"]
    assert (offline["acc"], offline["acc_norm"]) == (theirs["acc,none"], theirs["acc_norm,none"])


def test_question_mode_mistakes_are_one_line_errors(run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("lm_eval")
    from functools import partialmethod

    from lm_eval.tasks import TaskManager

    # an unknown name is looked for among lm-eval's own tasks too: leave those out (indexing them takes ~15 s)
    folder = write_mc_task(tmp_path / "tasks")
    monkeypatch.setattr(TaskManager, "__init__", partialmethod(TaskManager.__init__, include_defaults=False))
    for args, message in [(["--harness", "no_such_task_xyz", "--include-path", str(folder)], "unknown lm-eval task"),
                          (["--harness", "tiny_mc", "--include-path", str(tmp_path / "none")], "is not a folder"),
                          (["--harness", "tiny_mc", "--task", "builtin"], "not both"),
                          (["--task", "builtin", "--per-token"], "--per-token goes with --data"),
                          (["--data", "x.txt", "--include-path", str(folder)], "--include-path goes with --task"),
                          (["--data", "x.txt", "--task", "builtin"], "not both"),
                          ([], "eval needs --data")]:
        assert main(["eval", "--model", str(run), *args, "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_training_on_the_builtin_corpus_puts_the_builtin_task_accuracy_in_the_report_card(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))
    tiny = ["--model.d_model", "32", "--model.n_layer", "1", "--model.n_head", "2", "--model.n_kv_head", "2",
            "--model.d_ff", "64", "--model.max_seq_len", "256", "--block-size", "32", "--batch-size", "2",
            "--eval-iters", "1", "--sample-tokens", "0", "--threads", "1", "--no-progress", "--tokenizer", "char",
            "--steps", "2"]
    assert main(["train", "--out", str(tmp_path / "builtin"), *tiny]) == 0  # no --data: the built-in corpus
    capsys.readouterr()
    assert main(["eval", "--model", str(tmp_path / "builtin"), "--task", "builtin", "--json", "--no-report"]) == 0
    acc = json.loads(capsys.readouterr().out)["multiple_choice"]["acc"]
    report = (tmp_path / "builtin" / "report.md").read_text().splitlines()
    assert f"| task builtin | acc | {acc:.4f} | 100 |" in report
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The cat sat on the mat.\n" * 200)
    assert main(["train", "--out", str(tmp_path / "own"), "--data", str(corpus), *tiny]) == 0
    assert "task builtin" not in (tmp_path / "own" / "report.md").read_text()  # its own text: no stdlib questions


def test_a_context_too_short_for_the_builtin_questions_still_finishes_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))
    assert main(["train", "--out", str(tmp_path / "short"), "--model.d_model", "32", "--model.n_layer", "1",
                 "--model.n_head", "2", "--model.n_kv_head", "2", "--model.d_ff", "64", "--model.max_seq_len", "8",
                 "--batch-size", "2", "--eval-iters", "1", "--sample-tokens", "0", "--threads", "1",
                 "--no-progress", "--tokenizer", "char", "--steps", "1"]) == 0
    assert "built-in question task was not scored" in capsys.readouterr().err
    assert (tmp_path / "short" / "report.md").is_file()
