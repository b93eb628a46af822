"""The one device/dtype resolver (``tinyformer.devices``): the rules its docstring states, and the one-line
errors the commands that use it (train, generate, serve, eval) print."""

from __future__ import annotations

import pytest
import torch

from tinyformer import devices
from tinyformer.cli.main import main
from tinyformer.errors import ConfigError, GenerationError


@pytest.mark.parametrize(("cuda", "mps", "want"), [(True, True, "cuda"), (True, False, "cuda"),
                                                   (False, True, "mps"), (False, False, "cpu")])
def test_auto_device_prefers_cuda_then_mps_then_cpu(monkeypatch, cuda, mps, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(devices, "mps_available", lambda: mps)
    assert devices.resolve_device("auto") == torch.device(want)


def test_explicit_cpu_device_is_taken_as_named():
    assert devices.resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize(("name", "piece"), [("meta", "cannot run a model"), ("gpu", "unknown device"),
                                             ("cuda:0", "CUDA is not available"), ("mps", "MPS is not available")])
def test_bad_or_missing_device_raises_the_callers_error(monkeypatch, name, piece):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devices, "mps_available", lambda: False)
    with pytest.raises(ConfigError, match=piece):
        devices.resolve_device(name)
    with pytest.raises(GenerationError, match=piece):
        devices.resolve_device(name, GenerationError)


@pytest.mark.parametrize(("bf16", "want"), [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_dtype_on_cuda_is_bf16_where_supported_else_fp16(monkeypatch, bf16, want):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16)
    assert devices.resolve_dtype("auto", torch.device("cuda")) == want
    assert devices.autocast_dtype("auto", torch.device("cuda")) == want


@pytest.mark.parametrize("device", ["cpu", "mps"])
def test_auto_dtype_off_cuda_is_float32_weights_and_no_autocast(device):
    assert devices.resolve_dtype("auto", torch.device(device)) == torch.float32
    assert devices.autocast_dtype("auto", torch.device(device)) is None


@pytest.mark.parametrize(("name", "want"), [("float32", torch.float32), ("float16", torch.float16),
                                            ("bfloat16", torch.bfloat16)])
def test_dtype_names_map_to_torch_dtypes_and_back(name, want):
    assert devices.parse_dtype(name) == want
    assert devices.resolve_dtype(name, torch.device("cpu")) == want
    assert devices.DTYPE_NAMES[want] == name
    assert devices.parse_dtype(None) is None


def test_bfloat16_on_cpu_is_allowed_for_weights_and_autocast_but_float16_autocast_is_not():
    cpu = torch.device("cpu")
    assert devices.resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert devices.autocast_dtype("bfloat16", cpu) == torch.bfloat16
    assert devices.autocast_dtype("float32", cpu) is None
    with pytest.raises(ConfigError, match="needs a GPU"):
        devices.autocast_dtype("float16", cpu)


def test_unknown_dtype_name_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="'fp8' is not one of float32, float16, bfloat16"):
        devices.resolve_dtype("fp8", torch.device("cpu"))


def _one_line_exit_2(argv: list[str], capsys) -> str:
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def test_serve_refuses_a_device_that_cannot_run_a_model_in_one_line(tmp_path, capsys):
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    line = _one_line_exit_2(["serve", "--model", str(tmp_path / "absent"), "--device", "meta"], capsys)
    assert "'meta'" in line and "cannot run a model" in line  # checked before the run folder is read


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_generate_asking_for_missing_cuda_fails_in_one_line(tmp_path, capsys):
    line = _one_line_exit_2(["generate", "--model", str(tmp_path / "absent"), "--prompt", "x", "--device", "cuda"],
                            capsys)
    assert "CUDA is not available" in line
