import json

import pytest
import torch

from tinyformer.config import ModelConfig
from tinyformer.errors import CheckpointError
from tinyformer.models.decoder import DecoderLM
from tinyformer.run_folder import load_model, save_model


@pytest.mark.parametrize("tied", [True, False])
def test_save_then_load_gives_identical_logits(tmp_path, tied):
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=16,
                      tie_embeddings=tied)
    model = DecoderLM(cfg).eval()
    save_model(tmp_path / "run", model)
    again = load_model(tmp_path / "run")
    x = torch.randint(0, 40, (2, 10))
    assert torch.equal(model(x), again(x))
    if tied:
        assert again.lm_head.weight is again.tok_emb.weight


def test_saving_a_module_without_a_config_fails_before_writing_a_file(tmp_path):
    with pytest.raises(AttributeError):
        save_model(tmp_path / "run", torch.nn.Linear(4, 4))
    assert not (tmp_path / "run").exists()


def test_sharded_save_writes_index_and_loads(tmp_path):
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layer=3, n_head=4, max_seq_len=16, pos="learned",
                      norm="layernorm")
    model = DecoderLM(cfg).eval()
    save_model(tmp_path, model, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    again = load_model(tmp_path)
    x = torch.randint(0, 40, (1, 12))
    assert torch.equal(model(x), again(x))


def test_wrong_config_for_weights_is_a_clear_error(tmp_path):
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layer=2, n_head=4, max_seq_len=16)
    save_model(tmp_path, DecoderLM(cfg))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(tmp_path, cfg=cfg.replace(d_model=64))
    with pytest.raises(CheckpointError, match="missing tensor"):
        load_model(tmp_path, cfg=cfg.replace(n_layer=3))
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        load_model(tmp_path, cfg=cfg.replace(n_layer=1))


def test_corrupt_weights_are_reported_by_file(tmp_path):
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layer=1, n_head=4, max_seq_len=16)
    save_model(tmp_path, DecoderLM(cfg))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tmp_path)


def _maps_of(path) -> bool:
    """Whether this process has ``path`` memory-mapped (Linux: /proc/self/maps)."""
    import gc

    gc.collect()
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(str(path)) for line in f)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
@pytest.mark.parametrize("mapped", [True, False])
def test_unmapped_load_gives_the_same_model_and_leaves_no_memory_map_of_the_file(tmp_path, mapped):
    """A memory map keeps every page it touched resident while one tensor of the file lives: a caller that
    re-lays the weights out (Generator on a CPU) reads them instead, and holds no map afterwards."""
    from tinyformer.run_folder import iter_tensors

    cfg = ModelConfig(vocab_size=40, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=16)
    model = DecoderLM(cfg).eval()
    save_model(tmp_path / "run", model)
    weights = (tmp_path / "run" / "model.safetensors").resolve()
    again = load_model(tmp_path / "run", mapped=mapped)
    assert _maps_of(weights) == mapped  # the default (mapped) loader does map it: the probe sees maps
    x = torch.randint(0, 40, (2, 10))
    assert torch.equal(model(x), again(x))
    assert {k: v.dtype for k, v in iter_tensors(tmp_path / "run", mapped=mapped)} == \
        {k: v.dtype for k, v in iter_tensors(tmp_path / "run")}



@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
@pytest.mark.parametrize("run", ["decoder", "int8", "int4"])
def test_a_cpu_generator_holds_no_memory_map_of_its_weights(run):
    from pathlib import Path

    from tinyformer.generation.generator import Generator

    folder = Path(__file__).parent / "fixtures" / "runs" / run
    gen = Generator.from_run(folder)
    assert gen.model is not None and not _maps_of((folder / "model.safetensors").resolve())
