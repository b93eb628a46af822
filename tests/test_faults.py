"""Hostile and unlucky input: declared sizes past the file's end, configs no machine can build, full and
read-only disks, deeply nested JSON, two writers on one run folder, temporaries left by a killed run.

Each case ends as ONE line on stderr with exit code 2 (``fails_in_one_line``), and nothing already on
disk is lost. The commands run in this process through ``main``: an exception that is not handled
propagates and fails the test with its traceback.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
from test_cli_errors import fails_in_one_line, run, trained

from tinyformer.cli.main import main

SHARED_FIXTURES = (trained, run)  # test_cli_errors' tiny finished run (char tokenizer, 2 steps) and a copy


def _gguf_string(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def test_gguf_array_declaring_more_items_than_the_file_holds_is_refused_at_once(tmp_path, capsys):
    # 119 bytes: one string entry, then a u8 array that says it holds 10^12 items
    data = (b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + _gguf_string(b"general.architecture")
            + struct.pack("<I", 8) + _gguf_string(b"llama")
            + _gguf_string(b"x.bomb") + struct.pack("<IIQ", 9, 0, 10**12) + b"\0" * 20)
    path = tmp_path / "bomb.gguf"
    path.write_bytes(data)
    fails_in_one_line(["convert", "--from-gguf", str(path), "--out", str(tmp_path / "out")], capsys,
                      "bomb.gguf", "1,000,000,000,000 items", "only 20 remain")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("count_field", ["tensor_count", "kv_count", "string_length"])
def test_gguf_counts_past_the_end_are_refused(tmp_path, capsys, count_field):
    kv, tensors, key = 1, 0, _gguf_string(b"general.architecture")
    if count_field == "tensor_count":
        tensors = 2**40
    elif count_field == "kv_count":
        kv = 2**50
    else:
        key = struct.pack("<Q", 2**60) + b"general"
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, tensors, kv) + key + struct.pack("<I", 8)
                     + _gguf_string(b"llama"))
    fails_in_one_line(["convert", "--from-gguf", str(path), "--out", str(tmp_path / "out")], capsys,
                      "bad.gguf", "remain")


def _tiny_hf_folder(folder: Path, **config) -> Path:
    pytest.importorskip("transformers")
    from test_interop_common import hf_model, save_hf

    save_hf(hf_model("llama", num_hidden_layers=1), folder, tokenizer=False)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(config)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("field,value", [("intermediate_size", 10**9), ("max_position_embeddings", 10**12)])
def test_hf_config_no_machine_can_build_is_refused_before_import(tmp_path, capsys, monkeypatch, field, value):
    import tinyformer.sizing

    monkeypatch.setattr(tinyformer.sizing, "machine_memory_bytes", lambda: 8 * 10**9)  # an 8 GB machine
    src = _tiny_hf_folder(tmp_path / "hf", **{field: value})
    fails_in_one_line(["convert", "--from-hf", str(src), "--out", str(tmp_path / "out")], capsys,
                      "would allocate", "8.0 GB of memory")
    assert not (tmp_path / "out").exists()


def test_hf_config_declaring_more_layers_than_its_tensors_is_refused_before_planning(tmp_path, capsys):
    # 10^6 layers of width 64 may fit a large machine's memory, but building even their plan takes minutes
    src = _tiny_hf_folder(tmp_path / "hf", num_hidden_layers=10**6)
    fails_in_one_line(["convert", "--from-hf", str(src), "--out", str(tmp_path / "out")], capsys,
                      "1,000,000 layers", "tensors")


# ---------------------------------------------------------------------------- full and read-only disks


@contextlib.contextmanager
def mounted_tmpfs(folder: Path, options: str):
    """A tmpfs mounted at ``folder`` (``size=32k`` for a full disk, ``ro`` for a read-only one); the test is
    skipped where mounting is not allowed (not root, no CAP_SYS_ADMIN in a container). Root ignores file
    permission bits, so a chmod-ed folder would not be read-only for these tests."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


WRITERS = {  # argv writing to OUT, for each command that writes a run folder or a file
    "train": lambda run, out: ["train", "--data", str(run.parent / "corpus.txt"), "--tokenizer", "char",
                               "--out", str(out), "--model.d_model", "16", "--model.n_layer", "1", "--model.n_head",
                               "2", "--model.max_seq_len", "16", "--steps", "1", "--batch-size", "2",
                               "--eval-interval", "1", "--eval-iters", "1", "--sample-tokens", "2", "--threads", "1",
                               "--no-progress"],
    "to-hf": lambda run, out: ["convert", "--model", str(run), "--to-hf", str(out)],
    "quantize": lambda run, out: ["quantize", "--type", "int8", "--model", str(run), "--out", str(out)],
    "to-gguf": lambda run, out: ["convert", "--model", str(run), "--to-gguf", str(out) + ".gguf"],
}


@pytest.mark.parametrize("command", ["to-hf", "quantize", "to-gguf"])
def test_a_full_disk_is_one_line_and_leaves_no_partial_output(trained, tmp_path, capsys, command):
    with mounted_tmpfs(tmp_path / "small", "size=32k") as disk:
        fails_in_one_line(WRITERS[command](trained, disk / "out"), capsys, "No space left on device")
        assert sorted(p.name for p in disk.iterdir()) == []  # no partial folder, no temporary file


@pytest.mark.parametrize("command", sorted(WRITERS))
def test_a_read_only_output_is_one_line(trained, tmp_path, capsys, command):
    with mounted_tmpfs(tmp_path / "ro", "ro") as disk:
        fails_in_one_line(WRITERS[command](trained, disk / "out"), capsys, "Read-only file system", str(disk))


def test_resume_of_a_run_on_a_read_only_disk_is_one_line(trained, tmp_path, capsys):
    with mounted_tmpfs(tmp_path / "ro", "size=1m") as disk:
        shutil.copytree(trained, disk / "run")
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        fails_in_one_line(["train", "--resume", str(disk / "run"), "--steps", "3", "--no-progress"], capsys,
                          "Read-only file system")


def test_a_disk_that_fills_while_a_weight_file_is_written_keeps_the_old_output(trained, tmp_path, capsys,
                                                                                 monkeypatch):
    out = tmp_path / "q"
    assert main(WRITERS["quantize"](trained, out)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    fails_in_one_line([*WRITERS["quantize"](trained, out), "--force"], capsys, "No space left on device")
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("command", sorted(WRITERS))
def test_out_below_a_file_is_one_line_naming_the_file(trained, tmp_path, capsys, command):
    (tmp_path / "notes.txt").write_text("keep me")
    fails_in_one_line(WRITERS[command](trained, tmp_path / "notes.txt" / "sub"), capsys, "notes.txt",
                      "is a file, not a folder")
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_to_gguf_into_a_folder_says_it_is_a_folder_even_without_force(trained, tmp_path, capsys):
    fails_in_one_line(["convert", "--model", str(trained), "--to-gguf", str(tmp_path)], capsys, "is a folder")


def test_eval_prints_its_figures_and_warns_when_the_report_card_cannot_be_written(trained, run, capsys,
                                                                                    monkeypatch):
    import tinyformer.report_card

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(run / "report.md"))

    monkeypatch.setattr(tinyformer.report_card, "merge_eval_table", read_only)
    capsys.readouterr()
    assert main(["eval", "--model", str(run), "--data", str(trained.parent / "corpus.txt"),
                 "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "loss" in out and "perplexity" in out
    assert "warning: the report card was not updated" in err and "Read-only file system" in err


def test_eval_task_file_that_is_not_utf8_is_one_line(run, tmp_path, capsys):
    path = tmp_path / "task.jsonl"
    path.write_bytes(b'{"question": "caf\xe9", "choices": ["a", "b"], "answer": 0}\n')
    fails_in_one_line(["eval", "--model", str(run), "--task", str(path)], capsys, "task.jsonl", "not UTF-8",
                      "0xe9")


def test_an_argument_with_a_byte_that_is_not_utf8_is_refused_before_training(trained, tmp_path, capsys):
    data = os.fsdecode(bytes(tmp_path) + b"/corpus\xff.txt")
    shutil.copyfile(trained.parent / "corpus.txt", data)
    fails_in_one_line(["train", "--data", data, "--out", str(tmp_path / "out"), "--steps", "1"], capsys,
                      "not UTF-8", "0xff")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- nesting 10^5 deep

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "manifest.json",
                                  "model.safetensors.index.json"])
def test_json_nested_100000_deep_in_a_run_file_is_one_line(run, capsys, name):
    (run / name).write_text(DEEP)
    fails_in_one_line(["generate", "--model", str(run), "--prompt", "the", "--max-new-tokens", "2"], capsys,
                      "nested too deeply" if name in ("config.json", "tokenizer_config.json") else name)


def test_safetensors_header_nested_a_million_deep_is_one_line(run, capsys):
    header = b'{"a":' + b"[" * 10**6 + b"]" * 10**6 + b"}"
    header += b" " * (-len(header) % 8)
    (run / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    fails_in_one_line(["convert", "--model", str(run), "--to-hf", str(run.parent / "hf"), "--no-verify"], capsys,
                      "model.safetensors")


def test_sft_row_nested_100000_deep_is_one_line(run, tmp_path, capsys):
    path = tmp_path / "chats.jsonl"
    path.write_text('{"messages": ' + DEEP + "}\n")
    fails_in_one_line(["train", "--init-from", str(run), "--objective", "sft", "--data", str(path), "--out",
                       str(tmp_path / "sft"), "--steps", "1", "--threads", "1", "--no-progress"], capsys,
                      "nested too deeply")


# ---------------------------------------------------------------------------- --force and leftovers


def test_quantize_force_replaces_its_own_earlier_output(trained, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(WRITERS["quantize"](trained, out)) == 0
    assert (out / "loss.png").is_file()  # a side file of the training run, copied
    (out / "model.safetensors").write_bytes(b"stale")
    assert main([*WRITERS["quantize"](trained, out), "--force"]) == 0
    assert (out / "model.safetensors").read_bytes() != b"stale"
    (out / "mine.txt").write_text("not written by quantize")
    fails_in_one_line([*WRITERS["quantize"](trained, out), "--force"], capsys, "mine.txt")


@pytest.mark.parametrize("command,suffix", [("to-hf", ".partial"), ("to-gguf", ".tmp")])
def test_stale_temporaries_of_the_same_target_are_removed_by_the_next_run(trained, tmp_path, command, suffix):
    out = tmp_path / "out"
    name = out.name + (".gguf" if command == "to-gguf" else "")
    dead_pid = subprocess.Popen(["true"])  # a pid that no process has any more, once it is waited for
    dead_pid.wait()
    paths = {
        "killed": tmp_path / f".{name}.{dead_pid.pid}-x1{suffix}",  # its writer is gone: SIGKILL-ed
        "old": tmp_path / f".{name}.y2{suffix}",  # names no writer, untouched for an hour
        "running": tmp_path / f".{name}.{os.getppid()}-z3{suffix}",  # its writer is alive
        "fresh": tmp_path / f".{name}.w4{suffix}",  # names no writer, but written to just now
        "other": tmp_path / f".other.{dead_pid.pid}-v5{suffix}",  # another target's
    }
    for path in paths.values():
        if suffix == ".partial":
            path.mkdir()
            (path / "model.safetensors").write_bytes(b"half")
        else:
            path.write_bytes(b"half")
    old = time.time() - 3600
    for path in (paths["old"], *(paths["old"].iterdir() if paths["old"].is_dir() else ())):
        os.utime(path, (old, old))
    assert main(WRITERS[command](trained, out)) == 0
    assert {k for k, p in paths.items() if p.exists()} == {"running", "fresh", "other"}


# ---------------------------------------------------------------------------- a char corpus without a newline


def _train_args(data: Path, out: Path, steps: int = 2) -> list[str]:
    return ["train", "--data", str(data), "--tokenizer", "char", "--out", str(out), "--model.d_model", "16",
            "--model.n_layer", "1", "--model.n_head", "2", "--model.max_seq_len", "16", "--steps", str(steps),
            "--batch-size", "2", "--eval-interval", "1", "--eval-iters", "1", "--sample-tokens", "4",
            "--threads", "1", "--no-progress"]


def test_a_char_corpus_without_a_newline_trains_and_samples_from_the_default_prompt(tmp_path):
    from tinyformer.run_folder import load_tokenizer

    corpus = tmp_path / "one_line.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)  # no "\n" anywhere
    assert main(_train_args(corpus, tmp_path / "run")) == 0
    assert load_tokenizer(tmp_path / "run").encode("\n")  # the sampler's default prompt is in the vocabulary
    assert (tmp_path / "run" / "samples.txt").is_file()


def test_a_sample_prompt_the_tokenizer_cannot_encode_is_refused_before_step_1(tmp_path, capsys):
    from tinyformer.data.tokenizer import Tokenizer

    corpus = tmp_path / "c.txt"
    corpus.write_text("abc cab bca " * 200)
    Tokenizer.train_char("abc ").save(tmp_path / "tok.json")  # a tokenizer made elsewhere: no "\n"
    fails_in_one_line([*_train_args(corpus, tmp_path / "run"), "--tokenizer", str(tmp_path / "tok.json")], capsys,
                      "sample prompt", "--sample-tokens 0")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------- one writer per run folder


def test_a_second_writer_of_a_run_folder_gets_one_line_naming_the_holder(trained, run, capsys):
    from tinyformer.utils.io import folder_lock

    metrics = (run / "metrics.jsonl").read_bytes()
    with folder_lock(run):  # another `train` writing this run
        line = fails_in_one_line(["train", "--resume", str(run), "--steps", "4", "--no-progress"], capsys,
                                 "is being written by process", str(os.getpid()))
        assert "lock file" in line
        fails_in_one_line([*_train_args(trained.parent / "corpus.txt", run), "--force"], capsys,
                          "is being written by process")
    assert (run / "metrics.jsonl").read_bytes() == metrics  # neither wrote a record
    assert main(["train", "--resume", str(run), "--steps", "3", "--no-progress"]) == 0  # released on exit
    assert not (run.parent / f".{run.name}.lock").exists()


def test_the_lock_of_a_killed_writer_is_taken_over(run, capsys, cli_env):
    import signal
    import sys

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom tinyformer.utils.io import folder_lock\n"
                               f"with folder_lock({str(run)!r}):\n    print('locked', flush=True)\n"
                               "    time.sleep(60)"], env=cli_env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        fails_in_one_line(["train", "--resume", str(run), "--steps", "3", "--no-progress"], capsys,
                          f"process {holder.pid}")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    assert (run.parent / f".{run.name}.lock").exists()  # SIGKILL ran no cleanup: the file names a dead process
    assert main(["train", "--resume", str(run), "--steps", "3", "--no-progress"]) == 0
