"""report.md and the console (report_card.py): one figure, one value, one label; tokens as trained on;
the chat objectives' own schedule; derived runs' own cards; the built-in task's legend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_train_cli
import torch
from test_post_training import make_base_run, synthetic_preferences, write_jsonl

from tinyformer.cli.main import main
from tinyformer.training.metrics import read_metrics
from tinyformer.training.train_config import read_run_file

corpus = test_train_cli.corpus  # the fixture: a small corpus file

TINY = ["--model.d_model", "32", "--model.n_layer", "1", "--model.n_head", "2", "--model.n_kv_head", "2",
        "--model.d_ff", "64", "--model.max_seq_len", "32", "--batch-size", "4", "--block-size", "32",
        "--threads", "1", "--sample-tokens", "0", "--no-progress", "--tokenizer", "char"]


@pytest.fixture(autouse=True)
def _token_cache_and_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def card_figures(run: Path) -> list[str]:
    """The report card's figure lines (train loss and the held-out figure), without the list dash."""
    lines = (run / "report.md").read_text(encoding="utf-8").splitlines()
    return [line[2:] for line in lines if line.startswith("- ") and " loss (" in line]


def last_eval(run: Path) -> dict:
    return [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "eval"][-1]


# ---------------------------------------------------------------------------- one figure, one value


def test_console_and_report_card_give_the_same_train_and_validation_loss(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data", str(corpus), "--out", str(run), "--steps", "6", "--eval-interval", "3",
                 "--log-interval", "1", "--eval-iters", "2", "--warmup-steps", "2"]) == 0
    console = capsys.readouterr().out.splitlines()
    figures = card_figures(run)
    assert len(figures) == 2 and all(f in console for f in figures), (figures, console)
    # the train loss is the mean of the per-step losses since the previous evaluation (steps 4-6; every step
    # is logged at --log-interval 1), the held-out loss the trainer's over the same 2 batches each time
    losses = {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"}
    assert figures[0] == f"train loss (mean of steps 4-6): {sum(losses[s] for s in (4, 5, 6)) / 3:.4f}"
    record = last_eval(run)
    assert record["val_batches"] == 2
    assert figures[1].startswith(f"validation loss (step 6, 2 held-out batches): {record['val_loss']:.4f} (perplexity")
    assert sum(f"train loss (mean of steps 4-6): {record['train_loss']:.4f}" in line for line in console) == 2


def test_an_mlm_run_prints_the_report_cards_figures_and_counts_masked_tokens(corpus, tmp_path, capsys):
    run = tmp_path / "mlm"
    assert main(["train", *TINY, "--objective", "mlm", "--preset", "bert-tiny", "--data", str(corpus), "--out",
                 str(run), "--steps", "4", "--eval-interval", "2", "--eval-iters", "2", "--warmup-steps", "1"]) == 0
    console = capsys.readouterr().out
    figures = card_figures(run)
    assert [f.split(" (")[0] for f in figures] == ["train loss", "validation masked-token loss"]
    assert all(f in console.splitlines() for f in figures)
    tokens = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"][-1]["tokens"]
    assert tokens < 4 * 4 * 32 * 0.5  # ~15% of the positions carry the loss, not all 4 x 32 per step
    assert f"masked tokens trained on: {tokens:,}" in (run / "report.md").read_text()
    assert f"done: 4 steps, {tokens:,} masked tokens trained on" in console


def test_dpo_prints_one_held_out_loss_the_pair_mean_that_the_card_gives(tmp_path, capsys):
    base = make_base_run(tmp_path / "base")
    data = write_jsonl(tmp_path / "prefs.jsonl", synthetic_preferences(40))
    run = tmp_path / "dpo"
    assert main(["train", "--init-from", str(base), "--objective", "dpo", "--data", str(data), "--batch-size", "4",
                 "--eval-interval", "2", "--eval-iters", "1", "--threads", "1", "--no-progress", "--steps", "4",
                 "--out", str(run)]) == 0
    console = capsys.readouterr().out.splitlines()
    record = last_eval(run)
    heldout = f"held-out DPO loss (step 4, 1 held-out batches): {record['val_dpo_loss']:.4f}"
    assert heldout in card_figures(run) and heldout in console
    assert not any("final val loss" in line for line in console)
    # the trainer's held-out loss weighs pairs as the DPO loss does: the same mean as val_dpo_loss
    assert record["val_loss"] == pytest.approx(record["val_dpo_loss"], abs=1e-6)


# ---------------------------------------------------------------------------- tokens per step, schedules


def sft_rows() -> list[dict]:
    # every reply is two digits and a full stop: each conversation has the same number of assistant tokens
    return [{"messages": [{"role": "user", "content": f"What is {a} and {b}?"},
                          {"role": "assistant", "content": f"{a}{b}."}]} for a in range(10) for b in range(8)]


def test_sft_prints_the_assistant_tokens_it_trains_on_and_warms_up_for_a_tenth_of_its_steps(tmp_path, capsys):
    from tinyformer.data.chat_template import ChatTemplate, with_chatml
    from tinyformer.data.tokenizer import Tokenizer

    base = make_base_run(tmp_path / "base")
    data = write_jsonl(tmp_path / "chat.jsonl", sft_rows())
    run = tmp_path / "sft"
    assert main(["train", "--init-from", str(base), "--objective", "sft", "--data", str(data), "--batch-size", "4",
                 "--eval-interval", "10", "--eval-iters", "1", "--threads", "1", "--no-progress", "--steps", "20",
                 "--sample-tokens", "0", "--out", str(run)]) == 0
    console = capsys.readouterr().out
    tok = with_chatml(Tokenizer.load(base))
    _, mask = ChatTemplate(tok).encode_conversation(sft_rows()[0]["messages"])
    per_conversation = sum(mask[1:])  # the targets that carry the loss: assistant tokens after the first position
    start = next(line for line in console.splitlines() if line.startswith("objective sft"))
    assert f"4 conversations (~{per_conversation} assistant tokens each" in start
    assert f"~{4 * per_conversation} tokens per step" in start and " x 64 = " not in start
    total = 20 * 4 * per_conversation
    assert f"done: 20 steps, {total:,} assistant tokens trained on" in console
    assert f"assistant tokens trained on: {total:,}" in (run / "report.md").read_text()
    # warm-up: 10% of this run's 20 steps, said on the start-up line and kept in train.yaml for --resume
    assert "warm-up 2 steps (sft's default for 20 steps; --warmup-steps to change)" in start
    assert read_run_file(run / "train.yaml")["train"]["warmup_steps"] == 2


def test_a_given_warmup_is_kept_by_a_chat_objective(tmp_path, capsys):
    base = make_base_run(tmp_path / "base")
    data = write_jsonl(tmp_path / "chat.jsonl", sft_rows())
    assert main(["train", "--init-from", str(base), "--objective", "sft", "--data", str(data), "--batch-size", "4",
                 "--eval-interval", "2", "--eval-iters", "1", "--threads", "1", "--no-progress", "--steps", "2",
                 "--warmup-steps", "5", "--sample-tokens", "0", "--out", str(tmp_path / "sft")]) == 0
    start = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("objective sft"))
    assert "warm-up 5 steps;" in start
    assert read_run_file(tmp_path / "sft" / "train.yaml")["train"]["warmup_steps"] == 5


# ---------------------------------------------------------------------------- derived runs


def write_parent_card(run: Path) -> None:
    (run / "report.md").write_text("# Report card: base\n\n- validation loss (step 9, 1 held-out batches): 1.2345\n")


def assert_own_card(out: Path, what: str, parent: Path, parent_card: bool) -> str:
    card = (out / "report.md").read_text(encoding="utf-8")
    assert card.startswith(f"# Report card: {out.name}\n")
    assert what in card and f"- from: `{parent}`" in card
    assert "1.2345" not in card  # never the parent's figures under the new run's title
    assert (f"`{parent / 'report.md'}`" in card) == parent_card
    return card


def test_quantize_writes_its_own_card_with_the_report_errors(tmp_path, capsys):
    base = make_base_run(tmp_path / "base")
    write_parent_card(base)
    out = tmp_path / "q4"
    assert main(["quantize", "--model", str(base), "--out", str(out), "--type", "int4", "--group-size", "16",
                 "--report", "--json"]) == 0
    layers = json.loads(capsys.readouterr().out)["layers"]
    card = assert_own_card(out, "int4 weight-only quantization", base, parent_card=True)
    assert "groups of 16 input values per scale" in card
    for layer in layers:
        assert f"| {layer['name']} | {tuple(layer['shape'])} | {layer['max_abs_error']:.3e} |" in card


def test_convert_imports_and_merges_write_their_own_cards(corpus, tmp_path, capsys):
    base = make_base_run(tmp_path / "base")
    write_parent_card(base)
    hf, gguf = tmp_path / "hf", tmp_path / "base.gguf"
    assert main(["convert", "--model", str(base), "--to-hf", str(hf)]) == 0
    assert not (hf / "report.md").exists()  # an HF folder is no run folder: no card
    assert main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "imported")]) == 0
    assert_own_card(tmp_path / "imported", "a Hugging Face model folder imported", hf, parent_card=False)
    # a later conversion into the same folder replaces the card with the rest
    assert main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "imported"), "--force"]) == 0
    assert main(["convert", "--model", str(base), "--to-gguf", str(gguf)]) == 0
    assert main(["convert", "--from-gguf", str(gguf), "--out", str(tmp_path / "from-gguf")]) == 0
    assert_own_card(tmp_path / "from-gguf", "a GGUF file imported", gguf, parent_card=False)

    lora = tmp_path / "lora"
    assert main(["train", "--init-from", str(base), "--data", str(corpus), "--batch-size", "2", "--block-size", "16",
                 "--eval-interval", "1", "--eval-iters", "1", "--threads", "1", "--no-progress", "--steps", "1",
                 "--sample-tokens", "0", "--lora-rank", "2", "--out", str(lora)]) == 0
    assert main(["convert", "--model", str(lora), "--merge-lora", "--out", str(tmp_path / "merged")]) == 0
    card = (tmp_path / "merged" / "report.md").read_text()
    assert card.startswith("# Report card: merged\n") and "adapter merged into the base weights" in card
    assert f"`{lora / 'report.md'}`" in card


# ---------------------------------------------------------------------------- the built-in task's legend


def test_the_eval_table_names_the_builtin_task_and_its_chance_level(tmp_path):
    from tinyformer.evaluation.tasks import builtin_task
    from tinyformer.report_card import merge_eval_table

    stdlib = tmp_path / "stdlib"
    stdlib.mkdir()
    for module, cls in [("alpha", "A"), ("beta", "B"), ("gamma", "C"), ("delta", "D"), ("eps", "E")]:
        (stdlib / f"{module}.py").write_text(f"class {cls}: pass\n")
    items = builtin_task(5, stdlib_dir=stdlib)
    chance = {1 / len(item.choices) for item in items}
    assert chance == {0.25}
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.md").write_text("# Report card: run\n")
    merge_eval_table(run, [("task builtin", "acc", 0.31, 100)])
    merge_eval_table(run, [("task builtin", "acc_norm", 0.29, 100), ("text val", "loss", 2.5, 1000)])
    lines = (run / "report.md").read_text().splitlines()
    legend = [line for line in lines if line.startswith("task builtin:")]
    assert len(legend) == 1 and "Which module provides" in legend[0] and "chance level 0.25" in legend[0]
    assert lines.index(legend[0]) > lines.index("| task builtin | acc_norm | 0.2900 | 100 |")
    assert lines.index(legend[0]) < lines.index("<!-- /tinyformer eval -->")
