"""`tinyformer serve`: an OpenAI-compatible HTTP server (and playground at /) for a run folder."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from pathlib import Path

from tinyformer.cli.common import add_no_verify_flag
from tinyformer.errors import CheckpointError, ConfigError, TinyformerError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server with streaming and a web playground",
        description="Serve a run folder over HTTP: /v1/completions, /v1/chat/completions, /v1/models, /health, "
                    "and a playground at /. Requests that arrive together are decoded together (continuous "
                    "batching). Needs the 'serve' extra: pip install 'tinyformer[serve]'.")
    p.add_argument("--model", required=True, metavar="RUN", help="run folder (config.json, weights, tokenizer.json)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--model-name", default=None, help="model id clients must send (default: the folder name)")
    p.add_argument("--max-batch", type=int, default=16, help="KV-cache slots decoded together (default 16)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; beyond that the answer is 429 (default 64)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take, queueing included; 0 disables (default 600)")
    p.add_argument("--max-context", type=int, default=None,
                   help="positions per slot (default: the model's max_seq_len); lower it to save KV-cache memory")
    p.add_argument("--api-key", default=os.environ.get("TINYFORMER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $TINYFORMER_API_KEY, else none)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights dtype (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_no_verify_flag(p)
    p.set_defaults(func=run)


def _require_serve_extra() -> None:
    missing = []
    for name in ("fastapi", "uvicorn"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise TinyformerError(
            f"'tinyformer serve' needs {' and '.join(missing)}: pip install 'tinyformer[serve]'"
        )


def _listen(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a taken port is a one-line error, not a log line after startup."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise TinyformerError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    _require_serve_extra()
    import torch
    import uvicorn

    from tinyformer.run_folder import load_config, load_model, load_tokenizer
    from tinyformer.serve.app import create_app

    for flag, value, low in (("--max-batch", args.max_batch, 1), ("--max-queue", args.max_queue, 0),
                             ("--port", args.port, 0)):
        if value < low:
            raise ConfigError(f"{flag} must be >= {low}, got {value}")
    if args.port > 65535:
        raise ConfigError(f"--port must be <= 65535, got {args.port}")
    if args.request_timeout < 0:
        raise ConfigError(f"--request-timeout must be >= 0, got {args.request_timeout}")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")

    run_dir = Path(args.model)
    cfg = load_config(run_dir)
    if cfg.arch != "decoder":
        raise CheckpointError(f"{run_dir} holds an {cfg.arch} model; only decoder LMs generate text")
    if args.max_context is not None and not 1 <= args.max_context <= cfg.max_seq_len:
        raise ConfigError(f"--max-context must be in [1, {cfg.max_seq_len}] (the model's max_seq_len)")
    tokenizer = load_tokenizer(run_dir)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{run_dir}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                              f"{cfg.vocab_size}")
    sock = _listen(args.host, args.port)
    try:
        model = load_model(run_dir, device=device, dtype=getattr(torch, dtype_name), cfg=cfg,
                           verify=not args.no_verify)
        name = args.model_name or run_dir.resolve().name
        app = create_app(model, tokenizer, model_name=name, max_batch=args.max_batch, max_queue=args.max_queue,
                         request_timeout=args.request_timeout or None, api_key=args.api_key,
                         max_len=args.max_context)
        logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"serving {name!r} ({model.num_params() / 1e6:.1f}M parameters, {device}, {dtype_name}) on "
              f"http://{shown}:{port}  (playground: http://{shown}:{port}/ , API: http://{shown}:{port}/v1)",
              flush=True)
        server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=False,
                                               timeout_graceful_shutdown=3))
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # Ctrl-C is how a server is stopped: after a clean shutdown, not an error
            pass
    finally:
        sock.close()
    return 0
