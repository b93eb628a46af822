"""Masked-LM masking statistics, and the classic objectives end to end through `tinyformer train`."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tinyformer.cli.main import main
from tinyformer.models.encoder import EncoderModel
from tinyformer.models.seq2seq import Seq2SeqModel
from tinyformer.run_folder import load_config, load_model
from tinyformer.training.objectives.mlm import IGNORE, mask_tokens

CORPUS = "ROMEO: But soft, what light through yonder window breaks?\nJULIET: O Romeo, Romeo! wherefore art thou?\n"


def test_mlm_masking_follows_15_80_10_10():
    g = torch.Generator().manual_seed(0)
    specials = [0, 1, 2]
    ids = torch.randint(0, 1000, (200, 2000), generator=g)  # 400k tokens
    ids[:, 0] = 0  # a [CLS]-like special token in front of every row
    inputs, labels = mask_tokens(ids, mask_id=1000, random_ids=torch.arange(3, 1000), special_ids=specials,
                                 generator=g)
    candidates = ~torch.isin(ids, torch.tensor(specials))
    selected = labels != IGNORE
    assert not (selected & ~candidates).any(), "a special token was selected"
    assert torch.equal(labels[selected], ids[selected]), "labels must be the original tokens"
    assert torch.equal(inputs[~selected], ids[~selected]), "unselected tokens must be left alone"
    n = int(selected.sum())
    # binomial standard deviations: 0.0006 for the 15%, 0.0016 / 0.0012 for the 80% / 10% splits
    assert n / int(candidates.sum()) == pytest.approx(0.15, abs=0.003)
    masked = (inputs == 1000) & selected
    kept = (inputs == ids) & selected
    randomised = selected & ~masked & ~kept
    assert int(masked.sum()) / n == pytest.approx(0.80, abs=0.008)
    assert int(randomised.sum()) / n == pytest.approx(0.10, abs=0.006)
    assert int(kept.sum()) / n == pytest.approx(0.10, abs=0.006)
    assert inputs[randomised].min() >= 3 and inputs[randomised].max() < 1000  # random ordinary tokens only


def test_mlm_masking_always_leaves_something_to_predict():
    ids = torch.tensor([[0, 5, 6]])
    for seed in range(20):
        _, labels = mask_tokens(ids, mask_id=9, random_ids=torch.arange(3, 9), special_ids=[0],
                                generator=torch.Generator().manual_seed(seed))
        assert (labels != IGNORE).sum() >= 1 and labels[0, 0] == IGNORE



def _metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


QUIET = ["--no-progress", "--set", "train.tensorboard=false", "--set", "train.sample_tokens=0"]


def test_train_objective_mlm_then_embed(tmp_path, capsys, one_thread):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS * 20)
    run = tmp_path / "run"
    code = main(["train", "--objective", "mlm", "--preset", "bert-tiny", "--tokenizer", "char", "--data",
                 str(corpus), "--steps", "20", "--batch-size", "16", "--block-size", "32", "--lr", "3e-3",
                 "--warmup-steps", "3", "--eval-interval", "20", "--eval-iters", "2", "--log-interval", "10",
                 "--out", str(run), *QUIET])
    assert code == 0
    cfg = load_config(run)
    mask_id = cfg.extra["mlm"]["mask_token_id"]
    assert cfg.arch == "encoder" and cfg.mlm_head and cfg.vocab_size == mask_id + 1  # [MASK] got its own row
    assert isinstance(load_model(run), EncoderModel)
    losses = [m["loss"] for m in _metrics(run) if m["kind"] == "train"]
    uniform = math.log(cfg.vocab_size)  # the loss of an untrained model's near-uniform prediction
    assert losses[-1] < uniform - 0.3, (uniform, losses)
    capsys.readouterr()
    assert main(["embed", "--model", str(run), "--text", "ROMEO", "--text", "JULIET", "--text", "ROMEO"]) == 0
    vectors = [torch.tensor(e["vector"]) for e in json.loads(capsys.readouterr().out)["embeddings"]]
    assert all(abs(float(v.norm()) - 1) < 1e-4 for v in vectors)
    assert float(vectors[0] @ vectors[2]) == pytest.approx(1.0, abs=1e-5)


def test_train_task_runs_an_encoder_decoder_and_reports_exact_match(tmp_path, one_thread):
    run = tmp_path / "run"
    code = main(["train", "--objective", "seq2seq", "--task", "add", "--preset", "transformer-tiny", "--steps", "10",
                 "--batch-size", "16", "--eval-interval", "10", "--eval-iters", "2", "--log-interval", "5",
                 "--out", str(run), "--no-progress", "--set", "train.tensorboard=false"])
    assert code == 0
    assert isinstance(load_model(run), Seq2SeqModel)
    assert "held-out exact match" in (run / "samples.txt").read_text()


def test_embed_refuses_a_decoder(tmp_path, capsys):
    from tinyformer.config import ModelConfig
    from tinyformer.models.decoder import DecoderLM
    from tinyformer.run_folder import save_model

    save_model(tmp_path / "dec", DecoderLM(ModelConfig(vocab_size=16, d_model=16, n_layer=1, n_head=2)))
    assert main(["embed", "--model", str(tmp_path / "dec"), "--text", "x"]) == 2
    assert "needs an encoder" in capsys.readouterr().err
