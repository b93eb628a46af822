"""The fault matrix: what a hostile user (or a damaged disk) can throw at tinyformer, and how it answers.

    python benchmarks/fault_matrix.py              # ~2-4 minutes on 2 cores; prints a markdown table
    python benchmarks/fault_matrix.py --only cli   # one group: files, cli, http, load, templates

Every row counts k/N trials that ended as the README promises:

  files  each run file (config.json, tokenizer.json, tokenizer_config.json, train.yaml, metrics.jsonl,
         samples.txt, model.safetensors, state/step-N/trainer.json, optimizer.safetensors) damaged three
         ways (binary bytes, cut to half its length, empty) and then read by generate, eval and
         train --resume. A clean outcome is exit 0, or exit 2 with ONE line on stderr; never a traceback.
  cli    bad flag values and config files: exit 2 with one line naming the problem (the line must
         contain the expected words), before any work.
  http   `tinyformer serve` started on 127.0.0.1 (port 0) in a subprocess: malformed JSON, wrong types,
         impossible values, cross-site and DNS-rebinding requests, oversize bodies (declared 100 MB: 413
         before the body is sent; chunked: 413 at the limit). Each must get its expected 4xx status (and
         never a 5xx), and the server must still answer /health afterwards.
  load   the same server: C concurrent streaming requests all end with [DONE]; W waves of streams that
         the client abandons mid-way leave no slot busy (/health: 0 active, 0 waiting).
  templates  the run's chat template replaced by hostile ones (loops for ever, a huge power, a huge
         tojson indent, a huge string repetition, ...): `generate --chat` exits 2 with one line naming the
         limit hit; `serve` answers each chat request 400 with the reason while /health keeps answering.

The CLI rows run the commands in this process through ``tinyformer.cli.main.main`` (an exception that
is not a user error escapes as a traceback and counts as a failure); the server rows talk real HTTP.
Nothing is downloaded; everything is written under a temporary folder that is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tinyformer.cli.main import main as cli_main  # noqa: E402

CORPUS = "".join(f"line {i}: the quick brown fox jumps over the lazy dog; {i * 7 % 13} apples.\n" for i in range(300))


@dataclass
class Row:
    group: str
    trial: str
    expected: str
    ok: int = 0
    n: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, good: bool, what: str) -> None:
        self.n += 1
        self.ok += bool(good)
        if not good:
            self.failures.append(what)


# ------------------------------------------------------------------------------------------------ helpers


def run_cli(argv: list[str]) -> tuple[int | str, str]:
    """(exit code or 'traceback', stderr) of one in-process command."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc: int | str = cli_main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 -- anything else is the failure being counted
            traceback.print_exc(file=err)
            rc = "traceback"
    return rc, err.getvalue()


def one_line_error(rc: int | str, err: str) -> bool:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return rc == 2 and len(lines) == 1 and "Traceback" not in err


def clean(rc: int | str, err: str) -> bool:
    return (rc == 0 and "Traceback" not in err) or one_line_error(rc, err)


def make_run(root: Path) -> Path:
    (root / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    run = root / "run"
    rc, err = run_cli(["train", "--data", str(root / "corpus.txt"), "--tokenizer", "char", "--out", str(run),
                       "--model.d_model", "32", "--model.n_layer", "2", "--model.n_head", "2", "--model.d_ff", "64",
                       "--model.max_seq_len", "32", "--steps", "4", "--batch-size", "2", "--eval-interval", "2",
                       "--eval-iters", "1", "--sample-tokens", "8", "--warmup-steps", "1", "--threads", "1",
                       "--no-progress"])
    if rc != 0:
        raise SystemExit(f"could not train the test run: {err}")
    return run


# ------------------------------------------------------------------------------------------------ groups


def damaged_files(root: Path, run: Path) -> list[Row]:
    step = max((run / "state").glob("step-*"))
    files = ["config.json", "tokenizer.json", "tokenizer_config.json", "train.yaml", "metrics.jsonl", "samples.txt",
             "model.safetensors", f"state/{step.name}/trainer.json", f"state/{step.name}/optimizer.safetensors"]
    damage: dict[str, Callable[[bytes], bytes]] = {
        "binary": lambda b: bytes(range(256)) * 8,
        "cut in half": lambda b: b[: len(b) // 2],
        "empty": lambda b: b"",
    }
    (root / "eval.txt").write_text(CORPUS[:3000], encoding="utf-8")
    commands = {
        "generate": lambda r: ["generate", "--model", str(r), "--prompt", "line", "--max-new-tokens", "4",
                               "--seed", "0"],
        "eval": lambda r: ["eval", "--model", str(r), "--data", str(root / "eval.txt"), "--no-progress",
                           "--cache-dir", str(root / "cache")],
        "train --resume": lambda r: ["train", "--resume", str(r), "--steps", "5", "--no-progress"],
    }
    rows = []
    for name in files:
        row = Row("files", f"damaged `{name.replace(step.name, 'step-N')}`", "exit 0, or exit 2 with one line")
        for how, change in damage.items():
            for command, argv in commands.items():
                case = root / "case"
                shutil.rmtree(case, ignore_errors=True)
                shutil.copytree(run, case)
                target = case / name
                target.write_bytes(change(target.read_bytes()))
                rc, err = run_cli(argv(case))
                row.add(clean(rc, err), f"{how} / {command}: exit {rc}: {err.strip()[-300:]}")
        rows.append(row)
    shutil.rmtree(root / "case", ignore_errors=True)
    return rows


def bad_cli(root: Path, run: Path) -> list[Row]:
    (root / "bad.yaml").write_text("train:\n  lr: 0.1\n  steps: [1, 2\n")
    (root / "binary.yaml").write_bytes(bytes(range(256)))
    (root / "taken").write_text("a file")
    (root / "jsonl.jsonl").write_text('{"body": "no text field here"}\n')
    (root / "t.txt").write_text(CORPUS[:2000])
    out = str(root / "never")
    m = str(run)
    cases = [  # (argv, words the one line must contain)
        (["train", "--set", "model.max_seq_len=1000000000000", "--out", out], "would allocate"),
        (["train", "--set", "model.n_layer=1000000000", "--out", out], "would allocate"),
        (["train", "--config", str(root / "bad.yaml"), "--out", out], "bad.yaml, line 4, column 1"),
        (["train", "--config", str(root / "binary.yaml"), "--out", out], "not UTF-8"),
        (["train", "--tokenizer", "bpe", "--vocab-size", "100", "--out", out], "minimum is 259"),
        (["train", "--data", str(root / "jsonl.jsonl"), "--out", out], "no field 'text'"),
        (["train", "--parallel", "bogus", "--nproc", "2", "--out", out], "parallel"),
        (["train", "--steps", "0", "--out", out], "max_steps"),
        (["train", "--lr", "-1", "--out", out], "lr"),
        (["train", "--device", "meta", "--out", out], "device"),
        (["train", "--set", "train.nonsense=1", "--out", out], "nonsense"),
        (["train", "--out", out, "--threads", "0"], "threads"),
        (["eval", "--model", m, "--data", str(root / "t.txt"), "--block-size", "0"], "--block-size"),
        (["eval", "--model", m, "--data", str(root / "t.txt"), "--dtype", "int8"], "int8"),
        (["eval", "--model", m, "--data", str(root / "missing.txt")], "does not exist"),
        (["generate", "--model", m, "--prompt", "line", "--device", "meta"], "meta"),
        (["generate", "--model", m, "--prompt", "line", "--top-p", "0"], "top_p"),
        (["generate", "--model", m, "--prompt", "line", "--temperature", "-1"], "temperature"),
        (["generate", "--model", m, "--prompt", "line", "--max-new-tokens", "100000"], "context"),
        (["generate", "--model", str(root / "missing"), "--prompt", "x"], "does not exist"),
        (["inspect", "--model", m, "--prompt", "line", "--out", str(root / "taken")], "is a file"),
        (["embed", "--model", m, "--text", "x"], "encoder"),
        (["serve", "--model", m, "--port", "70000"], "--port"),
        (["serve", "--model", m, "--max-body-bytes", "0"], "--max-body-bytes"),
        (["convert", "--from-hf", str(root / "missing"), "--out", out], "missing"),
    ]
    row = Row("cli", "bad flag values and config files", "exit 2, one line naming the problem")
    for argv, words in cases:
        rc, err = run_cli(argv)
        row.add(one_line_error(rc, err) and words in err, f"{' '.join(argv[:3])} ...: exit {rc}: {err.strip()[-300:]}")
    missing_out = not Path(out).exists()
    row.add(missing_out, f"{out} was created by a failed command")
    return [row]


class ServeProcess:
    """`tinyformer serve` on 127.0.0.1 with a free port, in a subprocess."""

    def __init__(self, run: Path, *extra: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, "-m", "tinyformer", "serve", "--model", str(run), "--host",
                                      "127.0.0.1", "--port", "0", "--log-level", "warning", *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        line = self.proc.stdout.readline()
        if "http://" not in line:
            self.proc.kill()
            raise SystemExit(f"serve did not start: {line}{self.proc.stdout.read()}")
        address = line.split("on http://", 1)[1].split()[0].rstrip("/")
        self.url = "http://" + address
        self.host, self.port = address.rsplit(":", 1)
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # keep the pipe drained

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def raw_request(srv: ServeProcess, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                declared_length: int | None = None, send_body: bool = True) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 request over a plain socket (so that any header can be sent)."""
    head = {"Host": f"{srv.host}:{srv.port}", "Content-Type": "application/json", "Connection": "close",
            "Content-Length": str(len(body) if declared_length is None else declared_length), **(headers or {})}
    request = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items()) + "\r\n"
    with socket.create_connection((srv.host, int(srv.port)), timeout=60) as sock:
        sock.sendall(request.encode("latin-1") + (body if send_body else b""))
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return status, data.split(b"\r\n\r\n", 1)[-1]


def bad_http(run: Path) -> list[Row]:
    import httpx

    srv = ServeProcess(run, "--max-body-bytes", "65536")
    name = run.resolve().name
    ok = json.dumps({"model": name, "prompt": "line", "max_tokens": 2, "temperature": 0}).encode()
    chat = "/v1/chat/completions"
    cases: list[tuple[str, str, bytes, dict[str, str], int]] = [  # (what, path, body, headers, status)
        ("valid request", "/v1/completions", ok, {}, 200),
        ("not JSON", "/v1/completions", b"{not json", {}, 400),
        ("JSON array", "/v1/completions", b"[1, 2]", {}, 400),
        ("empty body", "/v1/completions", b"", {}, 400),
        ("invalid UTF-8", "/v1/completions", b'{"model": "\xff\xfe", "prompt": "a"}', {}, 400),
        ("deeply nested JSON", "/v1/completions", b"[" * 30000 + b"]" * 30000, {}, 400),
        ("missing model", "/v1/completions", b'{"prompt": "a"}', {}, 400),
        ("unknown model", "/v1/completions", json.dumps({"model": "nope", "prompt": "a"}).encode(), {}, 404),
        ("string max_tokens", "/v1/completions", json.dumps({"model": name, "prompt": "a", "max_tokens": "5"}).encode(),
         {}, 400),
        ("negative max_tokens", "/v1/completions",
         json.dumps({"model": name, "prompt": "a", "max_tokens": -1}).encode(), {}, 400),
        ("max_tokens past the context", "/v1/completions",
         json.dumps({"model": name, "prompt": "a", "max_tokens": 10**6}).encode(), {}, 400),
        ("n = 1000", "/v1/completions", json.dumps({"model": name, "prompt": "a", "n": 1000}).encode(), {}, 400),
        ("top_p = 0", "/v1/completions", json.dumps({"model": name, "prompt": "a", "top_p": 0}).encode(), {}, 400),
        ("token id out of range", "/v1/completions",
         json.dumps({"model": name, "prompt": [10**9], "max_tokens": 1}).encode(), {}, 400),
        ("character not in the vocabulary", "/v1/completions",
         json.dumps({"model": name, "prompt": "\u4e16\u754c", "max_tokens": 1}).encode(), {}, 400),
        ("chat without messages", chat, json.dumps({"model": name}).encode(), {}, 400),
        ("chat message of the wrong shape", chat,
         json.dumps({"model": name, "messages": [{"role": 5}]}).encode(), {}, 400),
        ("cross-site text/plain POST", "/v1/completions", ok,
         {"Origin": "http://evil.example", "Content-Type": "text/plain"}, 403),
        ("Sec-Fetch-Site: cross-site", "/v1/completions", ok, {"Sec-Fetch-Site": "cross-site"}, 403),
        ("DNS rebinding (Host: evil.example)", "/v1/completions", ok, {"Host": "evil.example"}, 403),
        ("GET on a POST route", "/v1/completions", b"", {}, 405),
        ("unknown route", "/v2/nothing", b"", {}, 404),
    ]
    rows = {"malformed": Row("http", "malformed or impossible requests", "its 4xx (never 5xx)"),
            "browser": Row("http", "cross-site and DNS-rebinding requests (no API key)", "403"),
            "size": Row("http", "oversize bodies (limit 64 KiB)", "413 before the body is read")}
    try:
        for what, path, body, headers, status in cases:
            method = "GET" if status == 405 or path == "/v2/nothing" else "POST"
            got, reply = raw_request(srv, method, path, body, headers)
            key = "browser" if status == 403 else "malformed"
            rows[key].add(got == status, f"{what}: {got} {reply[:200]!r}")
        # declared 100 MB, nothing sent: the answer must come without the body
        started = time.monotonic()
        got, reply = raw_request(srv, "POST", "/v1/completions", declared_length=100 * 2**20, send_body=False)
        rows["size"].add(got == 413 and time.monotonic() - started < 10, f"declared 100 MB: {got} {reply[:200]!r}")
        # chunked (no length), 1 MB in 1 KB chunks

        def chunks():
            for _ in range(1024):
                yield b" " * 1024

        r = httpx.post(srv.url + "/v1/completions", content=chunks(), timeout=60)
        rows["size"].add(r.status_code == 413, f"chunked 1 MB: {r.status_code} {r.text[:200]}")
        got, _ = raw_request(srv, "POST", "/v1/completions", b" " * 65537)
        rows["size"].add(got == 413, f"65,537 bytes with Content-Length: {got}")
        got, _ = raw_request(srv, "POST", "/v1/completions", ok)
        rows["size"].add(got == 200, f"a small body afterwards: {got}")
        health = httpx.get(srv.url + "/health", timeout=30)
        rows["malformed"].add(health.status_code == 200 and srv.proc.poll() is None, "server gone after the trials")
    finally:
        srv.close()
    return list(rows.values())


def load(run: Path, concurrent: int, waves: int) -> list[Row]:
    import httpx

    srv = ServeProcess(run, "--max-batch", "8", "--max-queue", "64")
    name = run.resolve().name
    body = {"model": name, "prompt": "line", "max_tokens": 24, "temperature": 0.8, "stream": True, "seed": 1}
    streams = Row("load", f"{concurrent} concurrent streaming completions", "all end with [DONE]")
    abandoned = Row("load", f"{waves} waves of {concurrent} streams abandoned after the first event",
                    "no slot stays busy")

    def stream(i: int, results: list[bool], abandon: bool) -> None:
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "seed": i}, timeout=120) as r:
                for line in r.iter_lines():
                    if abandon and line.startswith("data:"):
                        results[i] = True
                        return  # closing the response abandons the stream
                    if line == "data: [DONE]":
                        results[i] = r.status_code == 200
        except httpx.HTTPError:
            results[i] = False

    def wave(abandon: bool) -> list[bool]:
        results = [False] * concurrent
        workers = [threading.Thread(target=stream, args=(i, results, abandon)) for i in range(concurrent)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(180)
        return results

    try:
        for i, good in enumerate(wave(abandon=False)):
            streams.add(good, f"stream {i} did not end with [DONE]")
        for k in range(waves):
            results = wave(abandon=True)
            deadline = time.monotonic() + 30
            while True:
                stats = httpx.get(srv.url + "/health", timeout=30).json()
                idle = stats.get("active", 1) == 0 and stats.get("waiting", 1) == 0
                if idle or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            abandoned.add(idle and all(results), f"wave {k}: {stats}")
    finally:
        srv.close()
    return [streams, abandoned]


# ------------------------------------------------------------------------------------------------ report


HOSTILE_TEMPLATES = {  # what each does unchecked: minutes of CPU or gigabytes of memory
    "nested range(100000) loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "(n+8)**99999999": "{% set n = messages | length %}{{ (n + 8) ** 99999999 }}",
    "tojson(indent=10**9)": "{{ messages | tojson(indent=10**9) }}",
    "'a'*10**10": "{{ 'a' * 10**10 }}",
    "doubling a string 60 times": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                                  "{% endfor %}{{ ns.s }}",
    "text piled up in a set block": "{% set s %}{% for i in range(100000) %}{{ 'a' * 900000 }}{% endfor %}{% endset %}"
                                    "{{ s }}",
}


def with_template(root: Path, run: Path, index: int, template: str) -> Path:
    """A copy of ``run`` whose tokenizer carries ``template`` as its chat template."""
    folder = root / f"template-{index}"
    shutil.copytree(run, folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
    config_file.write_text(json.dumps({**config, "chat_template": template}), encoding="utf-8")
    return folder


def hostile_templates(root: Path, run: Path) -> list[Row]:
    import httpx

    cli = Row("templates", "hostile chat templates, `generate --chat --template-timeout 2`",
              "exit 2, one line naming the limit")
    for index, (name, template) in enumerate(HOSTILE_TEMPLATES.items()):
        rc, err = run_cli(["generate", "--model", str(with_template(root, run, index, template)), "--chat",
                           "--prompt", "line", "--max-new-tokens", "2", "--template-timeout", "2"])
        cli.add(one_line_error(rc, err) and "limit" in err, f"{name}: exit {rc}: {err.strip()[-300:]}")
    http = Row("templates", "serve, looping template: 4 chat requests at once, /health polled meanwhile",
               "400 naming the limit; /health 200 within 1 s")
    folder = with_template(root, run, len(HOSTILE_TEMPLATES), HOSTILE_TEMPLATES["nested range(100000) loops"])
    srv = ServeProcess(folder, "--template-timeout", "3")
    body = {"model": folder.resolve().name, "max_tokens": 2, "messages": [{"role": "user", "content": "line"}]}
    answers: list[httpx.Response] = []

    def chat() -> None:
        answers.append(httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120))

    try:
        clients = [threading.Thread(target=chat) for _ in range(4)]
        for c in clients:
            c.start()
        latencies = []  # each render holds a thread for the 3 s of its limit; the event loop must not wait
        while any(c.is_alive() for c in clients):
            started = time.monotonic()
            health = httpx.get(srv.url + "/health", timeout=30)
            latencies.append((health.status_code, time.monotonic() - started))
            time.sleep(0.2)
        slow = [(code, round(t, 2)) for code, t in latencies if code != 200 or t > 1.0]
        http.add(bool(latencies) and not slow, f"/health during the renders: {slow}")
        for r in answers:
            http.add(r.status_code == 400 and "time limit" in r.json()["error"]["message"],
                     f"chat: {r.status_code} {r.text[:200]}")
    finally:
        srv.close()
    return [cli, http]


def table(rows: list[Row]) -> str:
    lines = ["| group | trial | expected | result |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.group} | {r.trial} | {r.expected} | {r.ok}/{r.n} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["files", "cli", "http", "load", "templates"], action="append",
                        help="run only these groups (repeatable; default all)")
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--waves", type=int, default=3)
    args = parser.parse_args()
    groups = args.only or ["files", "cli", "http", "load", "templates"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="fault-matrix-") as tmp:
        root = Path(tmp)
        os.environ["TINYFORMER_CACHE"] = str(root / "cache")  # token files of this script stay in tmp
        run = make_run(root)
        if "files" in groups:
            rows += damaged_files(root, run)
        if "cli" in groups:
            rows += bad_cli(root, run)
        if "http" in groups:
            rows += bad_http(run)
        if "load" in groups:
            rows += load(run, args.concurrent, args.waves)
        if "templates" in groups:
            rows += hostile_templates(root, run)
    print_report(rows, started)


def print_report(rows: list[Row], started: float, load_before: tuple[float, ...] | None = None) -> None:
    """The table, the trial count, time and load, and the failures; exit 1 if any trial failed."""
    load_avg = os.getloadavg()
    before = f"{load_before[0]:.2f}, {load_before[1]:.2f}, {load_before[2]:.2f} before and " if load_before else ""
    print(table(rows))
    print(f"\n{sum(r.n for r in rows)} trials in {time.monotonic() - started:.0f} s; load average {before}"
          f"{load_avg[0]:.2f}, {load_avg[1]:.2f}, {load_avg[2]:.2f} at the end")
    failed = [r for r in rows if r.ok < r.n]
    for r in failed:
        print(f"\nFAILED {r.trial}:", *(f"  - {f}" for f in r.failures[:10]), sep="\n")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
