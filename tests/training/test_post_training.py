"""Post-training, part A: chat data, chat templates, SFT, DPO, preference scoring, the built-in sets, report.md."""

from __future__ import annotations

import hashlib
import json
import math
import string
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tinyformer.cli.main import main
from tinyformer.data.chat_data import read_chat_file, read_preference_file
from tinyformer.data.chat_template import CHATML_TEMPLATE, ChatTemplate, with_chatml
from tinyformer.data.tokenizer import Tokenizer
from tinyformer.errors import DataError
from tinyformer.presets import get_preset
from tinyformer.run_folder import load_model, load_tokenizer, save_model

pytestmark = pytest.mark.usefixtures("one_thread")

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What does  `str.strip` do?\nSay it short."},
    {"role": "assistant", "content": " Return a copy without leading and trailing whitespace.\n"},
    {"role": "user", "content": "And 2+2?"},
    {"role": "assistant", "content": "4, café."},
]
HF_CHATML_WITH_GENERATION = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(autouse=True)
def _token_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))


def char_tokenizer() -> Tokenizer:
    return Tokenizer.train_char(string.printable + "é`")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def make_base_run(folder: Path, *, tie: bool = True, max_seq_len: int = 64, seed: int = 0) -> Path:
    """A tiny untrained decoder run with a char tokenizer and no chat template (as `train` writes one)."""
    from tinyformer.models import build_model

    tok = char_tokenizer()
    cfg = get_preset("tiny", d_model=32, n_layer=1, n_head=2, n_kv_head=2, d_ff=64, max_seq_len=max_seq_len,
                     vocab_size=tok.vocab_size, tie_embeddings=tie)
    torch.manual_seed(seed)
    save_model(folder, build_model(cfg))
    tok.save(folder)
    return folder


# ---------------------------------------------------------------------------- chat data and the loss mask


def test_three_formats_give_the_same_tokens_and_mask(tmp_path: Path) -> None:
    system, user, reply = "Be brief.", "Name a colour", "Blue.\nOr red."
    openai = write_jsonl(tmp_path / "o.jsonl", [{"messages": [{"role": "system", "content": system},
                                                              {"role": "user", "content": f"{user}\n\nin French"},
                                                              {"role": "assistant", "content": reply}]}])
    sharegpt = write_jsonl(tmp_path / "s.jsonl", [{"conversations": [{"from": "system", "value": system},
                                                                     {"from": "human", "value": f"{user}\n\nin French"},
                                                                     {"from": "gpt", "value": reply}]}])
    alpaca = write_jsonl(tmp_path / "a.jsonl", [{"system": system, "instruction": user, "input": "in French",
                                                 "output": reply}])
    tok = with_chatml(char_tokenizer())
    files = (openai, sharegpt, alpaca)
    encoded = [ChatTemplate(tok).encode_conversation(read_chat_file(p).conversations[0].messages) for p in files]
    assert [read_chat_file(p).format for p in files] == ["openai", "sharegpt", "alpaca"]
    assert encoded[0] == encoded[1] == encoded[2]
    ids, mask = encoded[0]
    # an independent rendering: ChatML written out by hand; the mask is the reply and its <|im_end|>
    text = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}\n\nin French<|im_end|>\n"
            f"<|im_start|>assistant\n")
    assert ids == tok.encode(text + reply + "<|im_end|>\n")
    n_reply = len(tok.encode(reply)) + 1
    assert mask == [0] * len(tok.encode(text)) + [1] * n_reply + [0]


def test_mask_equals_hugging_face_assistant_tokens_mask_on_chatml() -> None:
    from transformers import PreTrainedTokenizerFast

    text = " ".join(f"The {w} does what `str.{w}` says, café 2+2=4.\n" for w in ("strip", "split", "join", "lower"))
    tok = with_chatml(Tokenizer.train_bpe(text * 20, 300))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    hf.chat_template = HF_CHATML_WITH_GENERATION
    out = hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = ChatTemplate(tok).encode_conversation(CONVERSATION)
    assert tok.chat_template == CHATML_TEMPLATE
    assert ids == list(out["input_ids"])
    assert mask == list(out["assistant_masks"])
    assert sum(mask) > 0


def test_bad_rows_are_one_line_errors_or_counted_skips(tmp_path: Path) -> None:
    unknown = write_jsonl(tmp_path / "u.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "yo"}]},
                                                 {"question": "?", "answer": "!"}])
    with pytest.raises(DataError, match=r"u\.jsonl:2: row fits no chat format"):
        read_chat_file(unknown)
    mixed = write_jsonl(tmp_path / "m.jsonl", [{"instruction": "a", "output": "b"}, {"text": "plain"}])
    with pytest.raises(DataError, match=r"m\.jsonl:2:"):
        read_chat_file(mixed)
    skips = write_jsonl(tmp_path / "s.jsonl", [{"messages": []},
                                               {"messages": [{"role": "user", "content": "only a question"}]},
                                               {"messages": [{"role": "user", "content": "q"},
                                                             {"role": "assistant", "content": "a"}]}])
    chat = read_chat_file(skips)
    assert len(chat.conversations) == 1
    assert chat.skipped == {"empty conversation": 1, "no assistant turn": 1}
    prefs = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "same", "rejected": "same"},
                                               {"prompt": "q", "chosen": "yes", "rejected": "no"}])
    read = read_preference_file(prefs)
    assert len(read.pairs) == 1 and read.skipped == {"chosen == rejected": 1}
    from tinyformer.training.objectives.dpo import encode_pair

    tok = with_chatml(char_tokenizer())
    long_prompt = read_preference_file(write_jsonl(tmp_path / "l.jsonl", [{"prompt": "x" * 40, "chosen": "yes",
                                                                          "rejected": "no"}])).pairs[0]
    assert encode_pair(long_prompt, 40, ChatTemplate(tok))[0] is None  # the prompt fills the context: skipped
    (chosen, rejected), cut = encode_pair(long_prompt, 60, ChatTemplate(tok))
    assert cut and len(chosen[0]) == 60 and chosen[1][-1] != -100  # cut to the context, reply tokens left


def test_bad_chat_data_on_the_command_line_is_one_line_and_exit_2(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    base = make_base_run(tmp_path / "base")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "q", "completion": "a"}])
    code = main(["train", "--init-from", str(base), "--objective", "sft", "--data", str(bad),
                 "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "bad.jsonl:1: row fits no chat format" in err
    assert main(["train", "--objective", "dpo", "--out", str(tmp_path / "out2"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "give --init-from RUN" in err


def test_prompt_longer_than_the_context_is_skipped_and_counted(tmp_path: Path) -> None:
    from tinyformer.training.runner import RunSpec, prepare_run

    base = make_base_run(tmp_path / "base", max_seq_len=48)
    rows = [{"messages": [{"role": "user", "content": "x" * 80}, {"role": "assistant", "content": "long"}]},
            {"messages": [{"role": "user", "content": "hi " * 8}, {"role": "assistant", "content": "y" * 40}]},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}]
    data = write_jsonl(tmp_path / "c.jsonl", rows)
    spec = RunSpec(train_overrides={"init_from": str(base), "objective": "sft", "data": str(data), "val_fraction": 0.0,
                                    "progress": False}, out=str(tmp_path / "sft"))
    objective = prepare_run(spec, log=lambda _: None).trainer.objective
    assert objective.skipped == {"no assistant token within the context": 1}
    assert objective.truncated == 2  # the skipped row and the long reply, which is cut
    assert len(objective.rows["train"]) == 2
    assert all(len(ids) <= 48 for ids, _ in objective.rows["train"])


# ---------------------------------------------------------------------------- ChatML added to a run


@pytest.mark.parametrize("tie", [True, False])
def test_chatml_tokens_keep_every_old_id_and_embedding(tmp_path: Path, tie: bool) -> None:
    from tinyformer.training.runner import RunSpec, prepare_run

    base = make_base_run(tmp_path / "base", tie=tie)
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION[1:3]}])
    spec = RunSpec(train_overrides={"init_from": str(base), "objective": "sft", "data": str(data), "val_fraction": 0.0,
                                    "progress": False}, out=str(tmp_path / "sft"))
    prepared = prepare_run(spec, log=lambda _: None)
    old_tok, old = load_tokenizer(base), load_model(base)
    new_tok, model = prepared.tokenizer, prepared.trainer.model
    n = old_tok.vocab_size
    assert new_tok.vocab_size == n + 2 and model.cfg.vocab_size == n + 2
    assert {t: new_tok.token_to_id(t) for t in old_tok.backend.get_vocab()} == old_tok.backend.get_vocab()
    assert [new_tok.token_to_id("<|im_start|>"), new_tok.token_to_id("<|im_end|>")] == [n, n + 1]
    emb = model.tok_emb.weight.detach()
    assert torch.equal(emb[:n], old.tok_emb.weight)
    assert torch.allclose(emb[n:], old.tok_emb.weight.mean(0).expand(2, -1))
    if tie:
        assert model.lm_head.weight is model.tok_emb.weight
    else:
        head = model.lm_head.weight.detach()
        assert torch.equal(head[:n], old.lm_head.weight)
        assert torch.allclose(head[n:], old.lm_head.weight.mean(0).expand(2, -1))
    saved = Tokenizer.load(tmp_path / "sft")
    assert saved.chat_template == CHATML_TEMPLATE and saved.vocab_size == n + 2


# ---------------------------------------------------------------------------- SFT


def test_sft_loss_is_the_mean_over_assistant_tokens_by_hand(tmp_path: Path) -> None:
    from tinyformer.training.runner import RunSpec, prepare_run

    base = make_base_run(tmp_path / "base", max_seq_len=256)
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[1:3]},
            {"messages": [{"role": "user", "content": "Add 2+3"}, {"role": "assistant", "content": "5"}]}]
    data = write_jsonl(tmp_path / "c.jsonl", rows)
    spec = RunSpec(train_overrides={"init_from": str(base), "objective": "sft", "data": str(data), "val_fraction": 0.0,
                                    "progress": False, "batch_size": 3}, out=str(tmp_path / "sft"))
    trainer = prepare_run(spec, log=lambda _: None).trainer
    objective, model = trainer.objective, trainer.model.double()
    batch = next(objective.eval_batches("train", 1))
    got = objective.loss(model, batch)
    # by hand: each conversation alone, log-softmax of its own logits, summed over its assistant tokens
    total, count = 0.0, 0
    for row in rows:
        ids, mask = objective.template.encode_conversation(row["messages"])
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0], -1)
        for t in range(len(ids) - 1):
            if mask[t + 1]:
                total -= float(logp[t, ids[t + 1]])
                count += 1
    assert count == int(batch["tokens"])
    assert math.isclose(float(got.detach()), total / count, rel_tol=1e-9)


def test_sft_run_resumes_exactly_and_writes_samples_and_report(tmp_path: Path) -> None:
    base = make_base_run(tmp_path / "base")
    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                          {"role": "assistant", "content": f"{a + b}."}]} for a in range(12) for b in range(6)]
    data = write_jsonl(tmp_path / "c.jsonl", rows)
    common = ["train", "--init-from", str(base), "--objective", "sft", "--data", str(data), "--batch-size", "4",
              "--eval-interval", "2", "--eval-iters", "2", "--threads", "1", "--no-progress", "--warmup-steps", "1",
              "--sample-tokens", "8"]
    assert main([*common, "--out", str(tmp_path / "full"), "--steps", "4"]) == 0
    assert main([*common, "--out", str(tmp_path / "cut"), "--steps", "2"]) == 0
    assert main(["train", "--resume", str(tmp_path / "cut"), "--steps", "4", "--no-progress"]) == 0

    def digest(run: Path) -> str:
        return hashlib.sha256((run / "model.safetensors").read_bytes()).hexdigest()

    assert digest(tmp_path / "full") == digest(tmp_path / "cut")
    samples = (tmp_path / "full" / "samples.txt").read_text()
    assert samples.count("Q: What is") == 2 * 3  # two evaluations, three held-out questions each
    report = (tmp_path / "full" / "report.md").read_text()
    last_eval = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
                 if '"eval"' in line][-1]
    assert (f"held-out assistant-token loss (step 4, {last_eval['val_batches']} held-out batches): "
            f"{last_eval['val_loss']:.4f}") in report
    assert report.count("**Q:**") == 5


# ---------------------------------------------------------------------------- DPO


def test_dpo_loss_equals_the_formula_and_trl() -> None:
    from trl.trainer.dpo_trainer import DPOTrainer

    from tinyformer.training.objectives.dpo import dpo_loss

    beta = 0.3
    pi_w, pi_l = torch.tensor([-3.0, -7.5, -1.25]), torch.tensor([-4.0, -2.0, -1.5])
    ref_w, ref_l = torch.tensor([-3.5, -6.0, -1.0]), torch.tensor([-3.0, -2.5, -2.0])
    losses, r_w, r_l = dpo_loss(pi_w, pi_l, ref_w, ref_l, beta)
    for i in range(3):
        z = beta * ((float(pi_w[i]) - float(ref_w[i])) - (float(pi_l[i]) - float(ref_l[i])))
        assert math.isclose(float(losses[i]), math.log1p(math.exp(-z)), rel_tol=1e-6)
        assert math.isclose(float(r_w[i] - r_l[i]), z, rel_tol=1e-6)

    # TRL's loss (DPOTrainer._compute_loss, sigmoid loss, precomputed reference) on the same numbers: the
    # policy's summed log-probs are handed over as per-token log-probs with one non-zero completion token
    B, T = 3, 4
    per_token = torch.zeros(2 * B, T - 1)
    per_token[:, 0] = torch.cat([pi_w, pi_l])

    def model(**_: object) -> SimpleNamespace:
        return SimpleNamespace(log_probs=per_token, entropy=torch.zeros(2 * B, T - 1),
                               mean_logits=torch.zeros(2 * B, T - 1), is_top1=torch.zeros(2 * B, T - 1, dtype=bool))

    identity = staticmethod(lambda t: t)
    accelerator = type("Acc", (), {"device": torch.device("cpu"), "gather": identity, "gather_for_metrics": identity})
    trl_self = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=accelerator(), aux_loss_enabled=False,
                               ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                               loss_types=["sigmoid"], loss_weights=[1.0], beta=beta, use_weighting=False,
                               label_smoothing=0.0, _metrics=defaultdict(lambda: defaultdict(list)),
                               _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(2 * B, T, dtype=torch.long), "attention_mask": torch.ones(2 * B, T),
              "completion_mask": torch.ones(2 * B, T, dtype=torch.long), "ref_chosen_logps": ref_w,
              "ref_rejected_logps": ref_l}
    trl_loss = DPOTrainer._compute_loss(trl_self, model, inputs, return_outputs=False)
    assert torch.allclose(losses.mean(), trl_loss, rtol=1e-6)


def synthetic_preferences(n: int) -> list[dict]:
    """Prompts of 6 digits with the letter a or b somewhere among them; the preferred reply is that letter, the
    other reply the other letter (symmetric, so an untrained model prefers the right one about half the time)."""
    g = torch.Generator().manual_seed(0)
    rows, seen = [], set()
    while len(rows) < n:
        digits = "".join(str(int(d)) for d in torch.randint(0, 10, (6,), generator=g))
        letter = "ab"[int(torch.randint(0, 2, (1,), generator=g))]
        at = int(torch.randint(0, 7, (1,), generator=g))
        prompt = digits[:at] + letter + digits[at:]
        if prompt not in seen:
            seen.add(prompt)
            rows.append({"prompt": prompt, "chosen": letter, "rejected": "b" if letter == "a" else "a"})
    return rows


def test_dpo_reference_stays_fixed_and_heldout_preference_accuracy_rises(tmp_path: Path) -> None:
    from tinyformer.training.objectives.dpo import score_pairs
    from tinyformer.training.runner import RunSpec, prepare_run

    base = make_base_run(tmp_path / "base", seed=3)
    data = write_jsonl(tmp_path / "prefs.jsonl", synthetic_preferences(160))
    spec = RunSpec(train_overrides={"init_from": str(base), "objective": "dpo", "data": str(data), "val_fraction": 0.25,
                                    "progress": False, "batch_size": 16, "max_steps": 40, "lr": 3e-3,
                                    "warmup_steps": 2, "eval_interval": 40, "eval_iters": 0, "dpo_beta": 0.5,
                                    "threads": 1}, out=str(tmp_path / "dpo"))
    trainer = prepare_run(spec, log=lambda _: None).trainer
    objective = trainer.objective
    before = {s: t.clone() for s, t in objective.ensure_reference(trainer.model).items()}
    # the reference is the --init-from model: its log-probs computed here independently of the objective
    init = load_model(tmp_path / "base")
    from tinyformer.training.objectives.sft import grow_vocab

    init_grown = type(init)(trainer.model.cfg)
    init_grown.load_state_dict(grow_vocab(init.state_dict(), trainer.model.cfg.vocab_size), strict=False)
    init_grown.lm_head.weight = init_grown.tok_emb.weight
    chosen, rejected = score_pairs(init_grown, objective.rows["val"], objective.pad_id, 7, "cpu")
    assert torch.allclose(before["val"], torch.stack([chosen, rejected], 1), atol=1e-5)
    accuracy_before = objective.reference_accuracy("val")
    assert 0.2 <= accuracy_before <= 0.8
    trainer.fit()
    assert all(torch.equal(before[s], objective.reference[s]) for s in before)
    after = objective.split_metrics(trainer.model, "val", trainer.device)
    assert after["val_preference_accuracy"] >= 0.9
    records = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["kind"] == "eval"][-1]
    assert {"train_reward_margin", "val_reward_margin", "train_preference_accuracy", "val_dpo_loss"} <= set(last)
    report = (tmp_path / "dpo" / "report.md").read_text()
    assert f"| {accuracy_before:.3f} | {after['val_preference_accuracy']:.3f} |" in report


def test_dpo_run_resumes_exactly(tmp_path: Path) -> None:
    base = make_base_run(tmp_path / "base")
    data = write_jsonl(tmp_path / "prefs.jsonl", synthetic_preferences(40))
    common = ["train", "--init-from", str(base), "--objective", "dpo", "--data", str(data), "--batch-size", "4",
              "--eval-interval", "2", "--eval-iters", "1", "--threads", "1", "--no-progress", "--warmup-steps", "1"]
    assert main([*common, "--out", str(tmp_path / "full"), "--steps", "4"]) == 0
    assert main([*common, "--out", str(tmp_path / "cut"), "--steps", "2"]) == 0
    assert main(["train", "--resume", str(tmp_path / "cut"), "--steps", "4", "--no-progress"]) == 0
    weights = [(tmp_path / run / "model.safetensors").read_bytes() for run in ("full", "cut")]
    assert weights[0] == weights[1]


# ---------------------------------------------------------------------------- eval, generate --chat, built-in sets


def test_eval_scores_preferences_and_chat_files_against_an_independent_rendering(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = make_base_run(tmp_path / "base")
    tok = with_chatml(load_tokenizer(base))
    tok.save(base)  # the run now has ChatML ids, with embedding rows for them
    model = load_model(base)
    from tinyformer.models import build_model
    from tinyformer.training.objectives.sft import grow_vocab

    grown = build_model(model.cfg.replace(vocab_size=tok.vocab_size))
    grown.load_state_dict(grow_vocab(model.state_dict(), tok.vocab_size), strict=False)
    grown.lm_head.weight = grown.tok_emb.weight
    save_model(base, grown)
    pairs = [{"prompt": "Pick one", "chosen": "left", "rejected": "right"},
             {"messages": [{"role": "user", "content": "2+2?"}], "chosen": "4", "rejected": "five"}]
    prefs = write_jsonl(tmp_path / "prefs.jsonl", pairs)
    assert main(["eval", "--model", str(base), "--data", str(prefs), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)

    def logp(prompt: str, reply: str) -> float:
        head = tok.encode(f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
        ids = head + tok.encode(reply + "<|im_end|>")
        with torch.no_grad():
            logits = grown(torch.tensor([ids[:-1]]))[0].double().log_softmax(-1)
        return sum(float(logits[t - 1, ids[t]]) for t in range(len(head), len(ids)))

    margins = [logp("Pick one", "left") - logp("Pick one", "right"), logp("2+2?", "4") - logp("2+2?", "five")]
    assert math.isclose(result["mean_logp_margin"], sum(margins) / 2, rel_tol=1e-4)
    assert result["preference_accuracy"] == sum(m > 0 for m in margins) / 2

    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "Pick one"},
                                                               {"role": "assistant", "content": "left"}]}])
    assert main(["eval", "--model", str(base), "--data", str(chat), "--json"]) == 0
    loss = json.loads(capsys.readouterr().out)["assistant_loss"]
    assert math.isclose(loss, -logp("Pick one", "left") / len(tok.encode("left<|im_end|>")), rel_tol=1e-4)

    assert main(["eval", "--model", str(base), "--data", str(prefs)]) == 0  # the line shows the JSON's figures
    assert (f"{base} on {prefs}: preference accuracy {result['preference_accuracy']:.4f}, mean log-prob margin "
            f"{result['mean_logp_margin']:.4f} (2 pairs, 0 skipped)") in capsys.readouterr().out
    assert main(["eval", "--model", str(base), "--data", str(chat)]) == 0
    assert f"{base} on {chat}: assistant-token loss {loss:.4f}, perplexity " in capsys.readouterr().out


def test_generate_chat_renders_the_prompt_with_the_template(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    base = make_base_run(tmp_path / "base")
    tok = with_chatml(load_tokenizer(base))
    tok.save(base)
    from tinyformer.models import build_model

    save_model(base, build_model(load_model(base).cfg.replace(vocab_size=tok.vocab_size)))
    common = ["generate", "--model", str(base), "--temperature", "0", "--max-new-tokens", "6", "--json"]
    assert main([*common, "--chat", "--prompt", "hello"]) == 0
    chat = json.loads(capsys.readouterr().out)
    assert main([*common, "--prompt", "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"]) == 0
    by_hand = json.loads(capsys.readouterr().out)
    im_end = tok.token_to_id("<|im_end|>")
    stop = by_hand["token_ids"].index(im_end) + 1 if im_end in by_hand["token_ids"] else None
    assert chat["token_ids"] == by_hand["token_ids"][:stop]


def test_builtin_instruction_set_answers_are_valid_python_for_the_names_asked(tmp_path: Path) -> None:
    import importlib
    import shutil
    import sysconfig

    from tinyformer.data.chat_data import is_heldout
    from tinyformer.data.instructions import builtin_conversations, builtin_preferences, heldout_questions
    from tinyformer.evaluation.tasks import instruction_task

    # two real standard-library modules stand for the whole library (parsing all of it takes seconds)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (tmp_path / "urllib").mkdir()
    shutil.copy(stdlib / "urllib" / "parse.py", tmp_path / "urllib" / "parse.py")
    shutil.copy(stdlib / "textwrap.py", tmp_path / "textwrap.py")
    conversations = builtin_conversations(tmp_path)
    qa = {c.messages[0]["content"]: c.messages[1]["content"] for c in conversations}
    assert len(qa) == len(conversations) >= 250
    assert qa["Write the import statement for `urllib.parse.urljoin`."] == "`from urllib.parse import urljoin`"
    assert qa["Which class is `str.removeprefix` a method of?"] == "`str`"
    kinds = defaultdict(int)
    for q, a in qa.items():  # each answer checked by Python itself, on the real modules
        code = a.strip("`")
        if q.startswith("Write the import statement for"):
            dotted = q.split("`")[1]
            namespace: dict = {}
            exec(code, namespace)  # the statement imports the very object the question names
            name = dotted.rsplit(".", 1)[1]
            assert namespace[name] is getattr(importlib.import_module(dotted.rsplit(".", 1)[0]), name)
        elif q.startswith("Which module is"):
            dotted = q.split("`")[1]
            assert getattr(importlib.import_module(code), dotted.rsplit(".", 1)[1]).__module__ == code
        elif q.startswith("After `import"):
            module, name = q.split("`")[1].removeprefix("import "), q.split("`")[3]
            root = module.split(".")[0]
            assert eval(code, {root: importlib.import_module(root)}) is getattr(
                importlib.import_module(module), name)
        elif q.startswith("Is `"):
            dotted = q.split("`")[1]
            module, _, name = dotted.rpartition(".")
            obj = getattr(importlib.import_module(module or "builtins"), name)
            assert a == ("A class." if isinstance(obj, type) else "A function.")
        else:
            assert q.startswith("Which class is")
            dotted = q.split("`")[1]
            module = next((m for m in ("urllib.parse", "textwrap") if dotted.startswith(m + ".")), "builtins")
            cls, method = dotted.removeprefix(module + ".").split(".")
            assert code == cls and callable(getattr(getattr(importlib.import_module(module), cls), method))
        kinds[q.split()[0]] += 1
    assert set(kinds) == {"Write", "Which", "After", "Is"}
    heldout = [q for q in qa if is_heldout(q, 0.1)]
    assert 0.05 * len(qa) < len(heldout) < 0.15 * len(qa)
    assert heldout_questions(0.1, tmp_path) == [(q, qa[q]) for q in heldout]
    rows = instruction_task(0.1, tmp_path)  # what `eval --task instructions` scores: the same questions, as chat rows
    assert sorted((r.prompt, r.answer) for r in rows) == sorted((q, qa[q]) for q in heldout)
    assert all(r.chat for r in rows)
    prefs = builtin_preferences(tmp_path)
    names = [q.split("`")[1] for q in qa if q.startswith("Is `")]  # one per module-level name
    assert len(prefs) == len(names)
    assert {p.prompt[0]["content"].split()[0] for p in prefs} == {"Write", "Which", "After", "Is"}
    assert all(p.chosen == qa[p.prompt[0]["content"]] and p.rejected != p.chosen for p in prefs)
    for p in prefs:  # the near miss of an import statement runs but does not bind the name asked for
        if p.prompt[0]["content"].startswith("Write the import"):
            namespace = {}
            exec(p.rejected.strip("`"), namespace)
            assert p.prompt[0]["content"].split("`")[1].rsplit(".", 1)[1] not in namespace


def test_pretraining_run_writes_a_report_card_with_its_validation_loss(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"The {a} cat sat on the {b} mat.\n" for a in ("big", "red", "old") for b in "xyz") * 8)
    assert main(["train", "--data", str(corpus), "--tokenizer", "char", "--out", str(tmp_path / "run"), "--steps",
                 "2", "--model.d_model", "32", "--model.n_layer", "1", "--model.n_head", "2", "--model.n_kv_head",
                 "2", "--model.d_ff", "64", "--model.max_seq_len", "32", "--batch-size", "2", "--eval-iters", "1",
                 "--sample-tokens", "0", "--threads", "1", "--no-progress"]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["kind"] == "eval"][-1]["val_loss"]
    report = (tmp_path / "run" / "report.md").read_text()
    assert f"validation loss (step 2, 1 held-out batches): {val:.4f} (perplexity {math.exp(val):.2f})" in report


# ---------------------------------------------------------------------------- with LoRA (components/lora.py)


def test_lora_sft_and_dpo_train_adapters_on_a_chatml_run_and_resume_exactly(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = make_base_run(tmp_path / "base")
    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                          {"role": "assistant", "content": f"{a + b}."}]} for a in range(12) for b in range(6)]
    chat = write_jsonl(tmp_path / "c.jsonl", rows)
    common = ["train", "--objective", "sft", "--data", str(chat), "--batch-size", "4", "--eval-interval", "2",
              "--eval-iters", "1", "--threads", "1", "--no-progress", "--warmup-steps", "1", "--sample-tokens", "0"]
    # the base has no chat template: its new ChatML rows could be neither trained nor stored by an adapter
    assert main([*common, "--init-from", str(base), "--lora-rank", "4", "--out", str(tmp_path / "x"),
                 "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "chat template" in err, err
    assert not (tmp_path / "x").exists()
    assert main([*common, "--init-from", str(base), "--out", str(tmp_path / "sft"), "--steps", "2"]) == 0
    lora = [*common, "--init-from", str(tmp_path / "sft"), "--lora-rank", "4", "--lr", "1e-2"]
    assert main([*lora, "--out", str(tmp_path / "full"), "--steps", "4"]) == 0
    assert main([*lora, "--out", str(tmp_path / "cut"), "--steps", "2"]) == 0
    assert main(["train", "--resume", str(tmp_path / "cut"), "--steps", "4", "--no-progress"]) == 0
    adapters = [(tmp_path / run / "adapter.safetensors").read_bytes() for run in ("full", "cut")]
    assert adapters[0] == adapters[1]
    assert not (tmp_path / "full" / "model.safetensors").exists()
    # DPO with LoRA on top of a LoRA run (its adapter merged into the base): B = 0 at the first step, so the
    # policy equals the reference (the policy with its adapters off) and the loss is -log sigmoid(0) = log 2
    prefs = write_jsonl(tmp_path / "prefs.jsonl", synthetic_preferences(24))
    assert main(["train", "--init-from", str(tmp_path / "full"), "--objective", "dpo", "--data", str(prefs),
                 "--lora-rank", "4", "--out", str(tmp_path / "dpo"), "--steps", "1", "--batch-size", "4",
                 "--eval-iters", "1", "--threads", "1", "--no-progress"]) == 0
    first = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("kind") == "train"][0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    # full DPO from the LoRA run: its reference is that run's merged weights, equal to the policy at the first step
    assert main(["train", "--init-from", str(tmp_path / "full"), "--objective", "dpo", "--data", str(prefs),
                 "--out", str(tmp_path / "dpo-full"), "--steps", "1", "--batch-size", "4", "--eval-iters", "1",
                 "--threads", "1", "--no-progress"]) == 0
    first = [json.loads(line) for line in (tmp_path / "dpo-full" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("kind") == "train"][0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    capsys.readouterr()
    assert main(["eval", "--model", str(tmp_path / "dpo"), "--data", str(prefs), "--json"]) == 0
    assert 0.0 <= json.loads(capsys.readouterr().out)["preference_accuracy"] <= 1.0
