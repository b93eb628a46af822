"""Shared test fixtures: small configs and deterministic seeds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

# tests/ mirrors the package's folders, and a test module may use another's helpers by module name
# (`from test_interop_common import save_hf`): every test folder is importable, as pytest's "prepend"
# import mode makes only the importing module's own folder.
for _folder in sorted(Path(__file__).resolve().parent.iterdir()):
    if _folder.is_dir() and _folder.name not in {"fixtures", "__pycache__"} and str(_folder) not in sys.path:
        sys.path.append(str(_folder))

# TINYFORMER_COMPILE=1 would make generate, chat and serve compile their decode step: the suite decodes
# eagerly whatever the developer's environment says (tens of seconds saved per command), except in the tests
# of the compiled step, which ask for it. Set here, so that the CLI subprocesses the tests start inherit it.
os.environ["TINYFORMER_COMPILE"] = "0"

# Tests run on 2 cores; more threads than cores only adds contention.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """One intra-op thread for a test of tiny models: a second thread only adds synchronisation (and
    stalls badly on a busy machine). Restores the thread count afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def cli_env() -> dict[str, str]:
    """Environment for subprocess runs of the CLI from the source tree."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    return env


PYTHON = sys.executable


# A small text with structure, for the tests that need a trained model (quantization, GGUF export).
TRAINED_CORPUS = ("the quick brown fox jumps over the lazy dog. a cat sat on the mat and the dog ran to the park. "
                  "she sells sea shells by the sea shore, and the shells she sells are sea shells for sure. ")


@pytest.fixture(scope="session")
def trained_char_run(tmp_path_factory):
    """(run folder, final training loss) of a char model trained here: 300 AdamW steps on TRAINED_CORPUS, ~10-20 s
    on one thread. Its next-token distributions are peaked and structured, unlike random weights."""
    from tinyformer.config import ModelConfig
    from tinyformer.data.tokenizer import build_tokenizer
    from tinyformer.models.decoder import DecoderLM
    from tinyformer.run_folder import save_model

    folder = tmp_path_factory.mktemp("trained")
    tok = build_tokenizer("char", TRAINED_CORPUS)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=128,
                      max_seq_len=256)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DecoderLM(cfg)
    data = torch.tensor(tok.encode(TRAINED_CORPUS * 6))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        starts = torch.randint(0, len(data) - 65, (16,))
        batch = torch.stack([data[s : s + 65] for s in starts])
        loss = model.loss(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(n)
    save_model(folder, model.eval())
    tok.save(folder / "tokenizer.json")
    return folder, float(loss.detach())
