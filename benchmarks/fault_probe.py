"""The fault probe: hostile inputs, full and read-only disks, two writers, a killed writer's leftovers, and a
server under SIGTERM and slow clients. A sibling of ``fault_matrix.py`` (same rows, same table).

    python benchmarks/fault_probe.py               # ~3-6 minutes on 2 cores; prints a markdown table
    python benchmarks/fault_probe.py --only http    # one group: bombs, disks, nesting, runs, http

  bombs    GGUF headers whose counts exceed the file (a u8 array of 10^12 items in 119 bytes, 2^50
           metadata entries, ...) and HF configs no machine can build (10^6 layers, 10^12 positions):
           `convert` exits 2 with one line within 30 s
  disks    a full disk (a 32 KiB tmpfs) and a read-only one (a read-only tmpfs, or a remount) under each
           writing command, `--out FILE/sub`, and eval on a read-only run (prints its figures, warns);
           needs root and mount(8): skipped otherwise
  nesting  JSON nested 10^5 deep in each run file, an SFT row and a task row; a safetensors header nested
           10^6 deep; a task file and a path that are not UTF-8
  runs     two `train --resume` of one run started together (one trains, one is refused naming the
           holder; the metrics stay in order); `quantize --force` over its own output; a `convert` killed
           with SIGKILL midway, then run again (no temporary of that target remains); a char corpus
           without a newline
  http     `tinyformer serve` in a subprocess: sampler values that overflow (400), a prompt 50x the
           context (400 naming the limit), the 413 of a body sent after the answer was (it must reach the
           client), slow-header sockets (closed), 1,100 idle sockets (/health answers), SIGTERM with
           streams open (every stream ends with a final event, exit 0)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_matrix import (  # noqa: E402
    ROOT,
    Row,
    ServeProcess,
    make_run,
    one_line_error,
    print_report,
    raw_request,
    run_cli,
)

ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def cli(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinyformer", *argv], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def gguf_string(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


# ------------------------------------------------------------------------------------------------ bombs


def bombs(root: Path) -> list[Row]:
    arch = gguf_string(b"general.architecture") + struct.pack("<I", 8) + gguf_string(b"llama")
    files = {
        "u8 array of 10^12 items": struct.pack("<IQQ", 3, 0, 2) + arch + gguf_string(b"x")
        + struct.pack("<IIQ", 9, 0, 10**12) + b"\0" * 20,
        "string array of 10^15 items": struct.pack("<IQQ", 3, 0, 2) + arch + gguf_string(b"x")
        + struct.pack("<IIQ", 9, 8, 10**15) + b"\0" * 20,
        "2^50 metadata entries": struct.pack("<IQQ", 3, 0, 2**50) + arch,
        "2^40 tensors": struct.pack("<IQQ", 3, 2**40, 1) + arch,
        "a key of 2^60 bytes": struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**60) + b"general",
    }
    gguf_row = Row("bombs", "GGUF counts past the end of the file", "exit 2, one line, < 30 s")
    for what, body in files.items():
        path = root / "bomb.gguf"
        path.write_bytes(b"GGUF" + body)
        start = time.monotonic()
        try:
            done = cli("convert", "--from-gguf", str(path), "--out", str(root / "bomb-out"), timeout=30)
            ok = one_line_error(done.returncode, done.stderr) and time.monotonic() - start < 30
            gguf_row.add(ok, f"{what}: exit {done.returncode}: {done.stderr.strip()[-200:]}")
        except subprocess.TimeoutExpired:
            gguf_row.add(False, f"{what}: still running after 30 s")
    import torch
    from safetensors.torch import save_file

    hf_row = Row("bombs", "HF configs no machine can build", "exit 2, one line, < 30 s")
    base = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}
    for what, change in {"num_hidden_layers 10^6": {"num_hidden_layers": 10**6},
                         "max_position_embeddings 10^12": {"max_position_embeddings": 10**12},
                         "hidden_size 10^6, intermediate_size 10^7": {"hidden_size": 10**6,
                                                                      "intermediate_size": 10**7}}.items():
        src = root / "hf-bomb"
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir()
        (src / "config.json").write_text(json.dumps({**base, **change}))
        save_file({"model.embed_tokens.weight": torch.zeros(64, 16)}, str(src / "model.safetensors"))
        try:
            done = cli("convert", "--from-hf", str(src), "--out", str(root / "hf-bomb-out"), timeout=30)
            hf_row.add(one_line_error(done.returncode, done.stderr),
                       f"{what}: exit {done.returncode}: {done.stderr.strip()[-200:]}")
        except subprocess.TimeoutExpired:
            hf_row.add(False, f"{what}: still running after 30 s")
    return [gguf_row, hf_row]


# ------------------------------------------------------------------------------------------------ disks


@contextlib.contextmanager
def tmpfs(folder: Path, options: str):
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        raise PermissionError(done.stderr.decode(errors="replace").strip())
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def writers(root: Path, run: Path) -> dict:
    gguf = root / "model.gguf"
    if not gguf.is_file():
        run_cli(["convert", "--model", str(run), "--to-gguf", str(gguf)])
    return {
        "train": lambda out: ["train", "--data", str(root / "corpus.txt"), "--tokenizer", "char", "--out", str(out),
                              "--model.d_model", "16", "--model.n_layer", "1", "--model.n_head", "2",
                              "--model.max_seq_len", "16", "--steps", "1", "--batch-size", "2", "--eval-interval",
                              "1", "--eval-iters", "1", "--sample-tokens", "2", "--threads", "1", "--no-progress"],
        "convert --to-hf": lambda out: ["convert", "--model", str(run), "--to-hf", str(out)],
        "quantize": lambda out: ["quantize", "--type", "int8", "--model", str(run), "--out", str(out)],
        "convert --to-gguf": lambda out: ["convert", "--model", str(run), "--to-gguf", str(out) + ".gguf"],
        "convert --from-gguf": lambda out: ["convert", "--from-gguf", str(gguf), "--out", str(out)],
        "inspect --out": lambda out: ["inspect", "--model", str(run), "--prompt", "line 1", "--out", str(out)],
    }


def disks(root: Path, run: Path) -> list[Row]:
    commands = writers(root, run)
    full = Row("disks", "full disk (32 KiB tmpfs)", "exit 2, one line, no partial output")
    read_only = Row("disks", "read-only output folder", "exit 2, one line naming it")
    below_file = Row("disks", "`--out FILE/sub`", "exit 2, one line naming the file")
    eval_row = Row("disks", "eval on a read-only run", "figures printed, a warning, exit 0")
    try:
        for name, argv in commands.items():
            # train keeps the folder of a run whose first checkpoint did not fit (to --resume it); inspect
            # writes pictures, which a later run overwrites
            with tmpfs(root / "full", "size=32k") as disk:
                rc, err = run_cli(argv(disk / "out"))
                left = sorted(p.name for p in disk.iterdir())
                ok = one_line_error(rc, err) and "space" in err.lower() and (name in ("train", "inspect --out")
                                                                            or not left)
                full.add(ok, f"{name}: exit {rc}, left {left}: {err.strip()[-200:]}")
            with tmpfs(root / "ro", "ro") as disk:
                rc, err = run_cli(argv(disk / "out"))
                read_only.add(one_line_error(rc, err) and "Read-only" in err, f"{name}: exit {rc}: {err[-200:]}")
        with tmpfs(root / "ro-run", "size=4m") as disk:
            shutil.copytree(run, disk / "run")
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
            rc, err = run_cli(["train", "--resume", str(disk / "run"), "--steps", "6", "--no-progress"])
            read_only.add(one_line_error(rc, err) and "Read-only" in err, f"train --resume: exit {rc}: {err[-200:]}")
            done = cli("eval", "--model", str(disk / "run"), "--data", str(root / "corpus.txt"), "--no-progress")
            eval_row.add(done.returncode == 0 and "perplexity" in done.stdout and "warning" in done.stderr,
                         f"exit {done.returncode}: {done.stdout[-200:]} {done.stderr[-200:]}")
    except PermissionError as exc:
        print(f"disks: no tmpfs mounts here ({exc}); those rows are left out", file=sys.stderr)
        full.n = read_only.n = eval_row.n = 0
    (root / "notes.txt").write_text("keep me")
    for name, argv in commands.items():
        rc, err = run_cli(argv(root / "notes.txt" / "sub"))
        below_file.add(one_line_error(rc, err) and "notes.txt" in err and (root / "notes.txt").read_text()
                       == "keep me", f"{name}: exit {rc}: {err.strip()[-200:]}")
    return [r for r in (full, read_only, below_file, eval_row) if r.n]


# ------------------------------------------------------------------------------------------------ nesting


def nesting(root: Path, run: Path) -> list[Row]:
    deep = "[" * 100_000 + "]" * 100_000
    row = Row("nesting", "JSON nested 10^5 deep (10^6 in a safetensors header)", "exit 2, one line")
    for name in ("config.json", "tokenizer_config.json", "manifest.json", "model.safetensors.index.json",
                 "model.safetensors"):
        case = root / "nest"
        shutil.rmtree(case, ignore_errors=True)
        shutil.copytree(run, case)
        if name == "model.safetensors":
            header = b'{"a":' + b"[" * 10**6 + b"]" * 10**6 + b"}"
            header += b" " * (-len(header) % 8)
            (case / name).write_bytes(struct.pack("<Q", len(header)) + header)
            argv = ["convert", "--model", str(case), "--to-hf", str(root / "nest-hf"), "--no-verify"]
        else:
            (case / name).write_text(deep)
            argv = ["generate", "--model", str(case), "--prompt", "line", "--max-new-tokens", "2"]
        rc, err = run_cli(argv)
        row.add(one_line_error(rc, err), f"{name}: exit {rc}: {err.strip()[-200:]}")
    (root / "chats.jsonl").write_text('{"messages": ' + deep + "}\n")
    rc, err = run_cli(["train", "--init-from", str(run), "--objective", "sft", "--data", str(root / "chats.jsonl"),
                       "--out", str(root / "sft"), "--steps", "1", "--no-progress"])
    row.add(one_line_error(rc, err), f"SFT row: exit {rc}: {err.strip()[-200:]}")
    (root / "task.jsonl").write_text('{"question": ' + deep + "}\n")
    rc, err = run_cli(["eval", "--model", str(run), "--task", str(root / "task.jsonl")])
    row.add(one_line_error(rc, err), f"task row: exit {rc}: {err.strip()[-200:]}")
    text = Row("nesting", "task file and paths that are not UTF-8", "exit 2, one line")
    (root / "latin1.jsonl").write_bytes(b'{"question": "caf\xe9", "choices": ["a", "b"], "answer": 0}\n')
    rc, err = run_cli(["eval", "--model", str(run), "--task", str(root / "latin1.jsonl")])
    text.add(one_line_error(rc, err) and "UTF-8" in err, f"task: exit {rc}: {err[-200:]}")
    odd = os.fsdecode(bytes(root) + b"/corpus\xff.txt")
    shutil.copyfile(root / "corpus.txt", odd)
    for argv in (["train", "--data", odd, "--out", str(root / "odd-run"), "--steps", "1"],
                 ["train", "--data", str(root / "corpus.txt"), "--out", os.fsdecode(bytes(root) + b"/r\xffn"),
                  "--steps", "1"]):
        rc, err = run_cli(argv)
        text.add(one_line_error(rc, err) and "UTF-8" in err, f"{argv[1:5]}: exit {rc}: {err[-200:]}")
    return [row, text]


# ------------------------------------------------------------------------------------------------ runs


def runs(root: Path, run: Path, trials: int) -> list[Row]:
    lock = Row("runs", "two `train --resume` of one run at once", "one trains, one refused; metrics in order")
    for k in range(trials):
        case = root / f"lock-{k}"
        shutil.copytree(run, case)
        argv = [sys.executable, "-m", "tinyformer", "train", "--resume", str(case), "--steps", "40",
                "--no-progress", "--threads", "1"]
        procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
                 for _ in range(2)]
        outs = [p.communicate(timeout=600) for p in procs]
        codes = sorted(p.returncode for p in procs)
        steps = [json.loads(line).get("step") for line in (case / "metrics.jsonl").read_text().splitlines()]
        refused = [err for p, (_, err) in zip(procs, outs, strict=True) if p.returncode == 2]
        ok = codes == [0, 2] and steps == sorted(steps) and bool(refused) and "being written by process" in refused[0]
        lock.add(ok, f"trial {k}: exit codes {codes}, steps {steps[-6:]}, {[e.strip()[-150:] for _, e in outs]}")
    force = Row("runs", "`quantize --force` over its own output", "exit 0")
    for k in range(trials):
        out = root / f"q-{k}"
        first = run_cli(["quantize", "--type", "int8", "--model", str(run), "--out", str(out)])
        again = run_cli(["quantize", "--type", "int8", "--model", str(run), "--out", str(out), "--force"])
        force.add(first[0] == 0 and again[0] == 0, f"trial {k}: {first[0]}, {again[0]}: {again[1][-200:]}")
    killed = Row("runs", "`convert` killed by SIGKILL midway, then run again", "no temporary of the target left")
    rng = random.Random(0)
    for k in range(trials * 2):
        kind = ("--to-hf", str(root / f"hf-{k}")) if k % 2 == 0 else ("--to-gguf", str(root / f"m-{k}.gguf"))
        proc = subprocess.Popen([sys.executable, "-m", "tinyformer", "convert", "--model", str(run), *kind],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
        time.sleep(rng.uniform(1.0, 4.0))
        proc.kill()
        proc.wait()
        target = Path(kind[1])
        rc, err = run_cli(["convert", "--model", str(run), *kind, "--force"])
        left = [p.name for p in root.iterdir() if p.name.startswith(f".{target.name}.")]
        killed.add(rc == 0 and not left, f"{kind[0]} trial {k}: exit {rc}, left {left}: {err[-200:]}")
    newline = Row("runs", "char corpus without a newline", "trains and samples, exit 0")
    (root / "one-line.txt").write_text("the quick brown fox jumps over the lazy dog. " * 60)
    argv = writers(root, run)["train"](root / "no-newline")
    argv[argv.index("--data") + 1] = str(root / "one-line.txt")
    rc, err = run_cli(argv)
    newline.add(rc == 0 and (root / "no-newline" / "samples.txt").is_file(), f"exit {rc}: {err[-300:]}")
    return [lock, force, killed, newline]


# ------------------------------------------------------------------------------------------------ http


class Served(ServeProcess):
    """fault_matrix's server subprocess, serving its model as "m", with JSON helpers."""

    def __init__(self, run: Path, *flags: str) -> None:
        super().__init__(run, "--model-name", "m", *flags)
        self.port = int(self.port)

    def post(self, body: dict) -> tuple[int, dict]:
        status, answer = raw_request(self, "POST", "/v1/completions", json.dumps(body).encode())
        return status, json.loads(answer)

    def health(self) -> dict:
        return json.loads(raw_request(self, "GET", "/health")[1])

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def slow_run(root: Path) -> Path:
    """A model large enough that streams of 2,000 tokens take seconds (SIGTERM must find them open)."""
    import string

    from tinyformer.config import ModelConfig
    from tinyformer.data.tokenizer import build_tokenizer
    from tinyformer.models.decoder import DecoderLM
    from tinyformer.run_folder import save_model

    run = root / "serve-run"
    tok = build_tokenizer("char", string.printable)
    save_model(run, DecoderLM(ModelConfig(vocab_size=tok.vocab_size, d_model=128, n_layer=4, n_head=4,
                                          max_seq_len=2048)))
    tok.save(run)
    return run


def http(root: Path, trials: int) -> list[Row]:
    run = slow_run(root)
    srv = Served(run, "--max-body-bytes", "1000000", "--header-timeout", "1", "--max-connections", "256")
    rows = []
    try:
        sampler = Row("http", "sampler values that overflow the logits", "400 naming the field")
        for field, value in (("repetition_penalty", 1e-308), ("repetition_penalty", 1e308),
                             ("temperature", 1e-308), ("temperature", 1e-40)):
            status, body = srv.post({"model": "m", "prompt": "hi", "max_tokens": 2, field: value})
            sampler.add(status == 400 and field in json.dumps(body), f"{field}={value}: {status} {body}")
        status, body = srv.post({"model": "m", "prompt": [5] * 100_000, "max_tokens": 2})
        context = Row("http", "a prompt of 10^5 ids (context 2,048)", "400 naming the limit, no negative count")
        message = json.dumps(body)
        context.add(status == 400 and "at most 2047 tokens" in message and not re.search(r" -\d", message), message)
        late = Row("http", "413 of an 8 MB body sent after the answer", "the client reads the 413")
        for k in range(trials * 3):
            with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                             b"\r\nContent-Length: 8388608\r\n\r\n")
                time.sleep(0.3)
                try:
                    sock.sendall(b" " * 8388608)
                    data = b""
                    while chunk := sock.recv(65536):
                        data += chunk
                except OSError as exc:
                    data = f"{type(exc).__name__}: {exc}".encode()
            late.add(data.startswith(b"HTTP/1.1 413") and b"too large" in data, f"trial {k}: {data[:120]!r}")
        slow = Row("http", "sockets sending one header byte each 0.5 s", "closed by the server within 3 s")
        socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(trials * 10)]
        start = time.monotonic()
        closed = [False] * len(socks)
        while time.monotonic() - start < 4 and not all(closed):
            for i, sock in enumerate(socks):
                if closed[i]:
                    continue
                try:
                    sock.sendall(b"G")
                    sock.settimeout(0.01)
                    closed[i] = sock.recv(100) is not None
                except TimeoutError:
                    pass
                except OSError:
                    closed[i] = True
            time.sleep(0.5)
        for i, sock in enumerate(socks):
            slow.add(closed[i], f"socket {i} still open after {time.monotonic() - start:.1f} s")
            sock.close()
        idle = Row("http", "/health while 1,100 idle sockets are open (cap 256)", "200")
        flood = []
        try:
            for _ in range(1100):
                flood.append(socket.create_connection(("127.0.0.1", srv.port), timeout=10))
                flood[-1].sendall(b"GET /he")
            for k in range(trials * 3):
                try:
                    idle.add(srv.health()["status"] == "ok", f"trial {k}")
                except OSError as exc:
                    idle.add(False, f"trial {k}: {exc}")
        finally:
            for sock in flood:
                sock.close()
        rows += [sampler, context, late, slow, idle]
    finally:
        srv.close()
    rows += sigterm(run, trials)
    return rows


def _stream(url: str, results: list, ended: list, i: int) -> None:
    """One streamed completion of 2,000 tokens: its events into ``results[i]``, its end time into ``ended[i]``."""
    body = json.dumps({"model": "m", "prompt": "a", "max_tokens": 2000, "ignore_eos": True, "stream": True})
    req = urllib.request.Request(url + "/v1/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            events = [line.decode().strip()[6:] for line in r if line.startswith(b"data: ")]
        results[i], ended[i] = events, time.monotonic()
    except Exception as exc:  # noqa: BLE001 -- a cut stream is the failure being counted
        results[i] = f"{type(exc).__name__}: {exc}"


def sigterm(run: Path, trials: int) -> list[Row]:
    ends = Row("http", "SIGTERM with 24 streams open (4 running, 20 queued)", "each ends with a final event")
    exits = Row("http", "... the process after SIGTERM (--shutdown-timeout 3)", "exit 0, streams ended in 3 s")
    for k in range(trials):
        srv = Served(run, "--max-batch", "4", "--max-queue", "32", "--shutdown-timeout", "3", "--threads", "1")
        results: list = [None] * 24
        ended: list = [None] * 24

        threads = [threading.Thread(target=_stream, args=(srv.url, results, ended, i), daemon=True)
                   for i in range(24)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(srv.health()[k] for k in ("active", "waiting")) < 24:
            time.sleep(0.05)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(60)
        for t in threads:
            t.join(30)
        for i, events in enumerate(results):
            good = isinstance(events, list) and len(events) >= 2 and events[-1] == "[DONE]"
            if good:
                last = json.loads(events[-2])
                good = "error" in last or last["choices"][0]["finish_reason"] in ("stop", "length")
            ends.add(good, f"trial {k} stream {i}: {events if not isinstance(events, list) else events[-2:]}")
        took = max((t - start for t in ended if t is not None), default=0.0)
        exits.add(srv.proc.returncode == 0 and took < 3.5, f"trial {k}: exit {srv.proc.returncode}, {took:.1f} s")
    return [ends, exits]


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    groups_all = ["bombs", "disks", "nesting", "runs", "http"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=groups_all, action="append", help="run only these groups (repeatable)")
    parser.add_argument("--trials", type=int, default=3, help="repetitions of the timing-dependent trials")
    args = parser.parse_args()
    groups = args.only or groups_all
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    before = os.getloadavg()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="fault-probe-") as tmp:
        root = Path(tmp)
        os.environ["TINYFORMER_CACHE"] = str(root / "cache")
        ENV["TINYFORMER_CACHE"] = str(root / "cache")
        run = make_run(root)
        if "bombs" in groups:
            rows += bombs(root)
        if "disks" in groups:
            rows += disks(root, run)
        if "nesting" in groups:
            rows += nesting(root, run)
        if "runs" in groups:
            rows += runs(root, run, args.trials)
        if "http" in groups:
            rows += http(root, args.trials)
    print_report(rows, started, before)


if __name__ == "__main__":
    main()
