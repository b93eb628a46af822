"""`tinyformer serve`: an OpenAI-compatible HTTP server (and playground at /) for a run folder."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path

from tinyformer.cli.common import add_decoding_args, decide_compile, speculative_from_args, template_timeout
from tinyformer.errors import CheckpointError, ConfigError, TinyformerError
from tinyformer.serve import (
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_SHUTDOWN_TIMEOUT,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server with streaming and a web playground",
        description="Serve a run folder over HTTP: /v1/completions, /v1/chat/completions, /v1/models, /health, "
                    "/tokenize, /detokenize, /apply-template, /props, and a playground at / (a chat that shows "
                    "the prompt, its tokens and each token's probability and alternatives; for an encoder run, "
                    "the cosine similarities of sentences); an encoder run serves /v1/embeddings. "
                    "Requests that arrive together are decoded together (continuous batching). "
                    "Needs the 'serve' extra: pip install 'tinyformer[serve]'.")
    add_decoding_args(p, "torch.compile-d steps, one per bucket of 1, 2, 4, ... --max-batch requests, all compiled "
                         "at start-up before the server answers")
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
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $TINYFORMER_API_KEY, else none). "
                        "Without a key, browser requests from other sites are refused and, bound to loopback, "
                        "only Host: localhost / 127.0.0.1 is served")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help=f"largest request body; larger ones get 413 unread (default {DEFAULT_MAX_BODY_BYTES:,})")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT, metavar="S",
                   help="on SIGTERM / Ctrl-C, seconds before the process exits: running requests may finish "
                        "for S - 1 s, then every open stream ends with a 'shutting down' error event "
                        f"(default {DEFAULT_SHUTDOWN_TIMEOUT:g})")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT, metavar="S",
                   help="seconds a connection may take to send its request head (408 after that), and a request "
                        f"to send each part of its body (default {DEFAULT_HEADER_TIMEOUT:g})")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="open connections at most: one more closes the oldest that has not sent a request yet "
                        f"(default {DEFAULT_MAX_CONNECTIONS}, lowered to fit the open-file limit)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web origin (e.g. http://localhost:3000) whose pages may call the API without a key "
                        "(repeatable)")
    p.add_argument("--prefill-chunk", type=int, default=256, metavar="N",
                   help="prompt tokens a request feeds per step at most, so long prompts interleave with the "
                        "decoding of running requests (default 256)")
    p.add_argument("--prefix-cache-mb", type=float, default=0, metavar="MB",
                   help="keep the keys/values of finished requests in a prefix cache of this size, so requests "
                        "sharing a prefix (a system prompt, a growing chat) prefill only the rest (default 0: off)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the cores not busy at start, less one for the HTTP event loop; "
                        "see utils/threads.py)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def _require_serve_extra() -> None:
    missing = []
    for name in ("fastapi", "uvicorn"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise TinyformerError(f"'tinyformer serve' needs {' and '.join(missing)}: pip install 'tinyformer[serve]'")


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

    from tinyformer.devices import resolve_device, resolve_dtype
    from tinyformer.generation.weight_layout import load_for_decoding
    from tinyformer.run_folder import load_config, load_tokenizer
    from tinyformer.serve.app import create_app
    from tinyformer.serve.guard import is_loopback_host
    from tinyformer.serve.http_server import make_server

    for flag, value, low in (("--max-batch", args.max_batch, 1), ("--max-queue", args.max_queue, 0),
                             ("--prefill-chunk", args.prefill_chunk, 1), ("--prefix-cache-mb", args.prefix_cache_mb, 0),
                             ("--port", args.port, 0), ("--max-body-bytes", args.max_body_bytes, 1),
                             ("--max-connections", args.max_connections, 1)):
        if value < low:
            raise ConfigError(f"{flag} must be >= {low}, got {value}")
    if args.port > 65535:
        raise ConfigError(f"--port must be <= 65535, got {args.port}")
    if args.request_timeout < 0:
        raise ConfigError(f"--request-timeout must be >= 0, got {args.request_timeout}")
    for flag, value in (("--shutdown-timeout", args.shutdown_timeout), ("--header-timeout", args.header_timeout)):
        if not 0 < value < float("inf"):
            raise ConfigError(f"{flag} must be a number of seconds > 0, got {value}")
    timeout_s = template_timeout(args)
    speculative = speculative_from_args(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")

    run_dir = Path(args.model)
    cfg = load_config(run_dir)
    if cfg.arch not in ("decoder", "encoder"):  # an encoder run is served for /v1/embeddings and /tokenize
        raise CheckpointError(f"{run_dir} holds an {cfg.arch} model; serve takes a decoder LM or an encoder")
    if cfg.arch == "encoder" and args.compile:  # the default (None) just means no decoding to compile
        raise ConfigError("--compile compiles the decode step; an encoder run does not decode")
    if args.max_context is not None and not 1 <= args.max_context <= cfg.max_seq_len:
        raise ConfigError(f"--max-context must be in [1, {cfg.max_seq_len}] (the model's max_seq_len)")
    tokenizer = load_tokenizer(run_dir)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{run_dir}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                              f"{cfg.vocab_size}")
    sock = _listen(args.host, args.port)
    if args.api_key is None and not is_loopback_host(args.host):
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach this address can use "
              "the model (and its compute); see README 'Serving safely'", file=sys.stderr, flush=True)
    try:
        # as generate: on a CPU, weights read (not mapped) and linear layers laid out for batch-1 products
        model = load_for_decoding(run_dir, device, dtype, not args.no_verify, cfg, prepare=cfg.arch == "decoder")
        draft = None
        if args.draft_model is not None:
            from tinyformer.generation.generator import check_draft

            draft = load_for_decoding(args.draft_model, device, dtype, not args.no_verify)
            check_draft(model, tokenizer, draft, load_tokenizer(args.draft_model))
        from tinyformer.generation.compile_cache import PackageBuild

        compile = cfg.arch == "decoder" and decide_compile(args.compile, model, "the decode steps", run_dir=run_dir,
                                                           dtype=dtype)
        name = args.model_name or run_dir.resolve().name
        app = create_app(model, tokenizer, model_name=name, max_batch=args.max_batch, max_queue=args.max_queue,
                         request_timeout=args.request_timeout or None, api_key=args.api_key,
                         max_len=args.max_context, max_body_bytes=args.max_body_bytes, bind_host=args.host,
                         allowed_origins=tuple(args.allow_origin), compile=compile,
                         prefill_chunk=args.prefill_chunk, prefix_cache_mb=args.prefix_cache_mb,
                         template_timeout=timeout_s, body_timeout=args.header_timeout,
                         speculative=speculative, draft_model=draft)
        logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        if compile is True or (isinstance(compile, PackageBuild) and compile.background_run is None):
            sizes = ", ".join(map(str, app.state.server.scheduler.engine.buckets()))
            print(f"compiling the decode step for {sizes} requests at a time before serving", flush=True)
        print(f"serving {name!r} ({model.num_params() / 1e6:.1f}M parameters, {device}, {dtype_name}) on "
              f"http://{shown}:{port}  (playground: http://{shown}:{port}/ , API: http://{shown}:{port}/v1)",
              flush=True)
        server = make_server(app, log_level=args.log_level, shutdown_timeout=args.shutdown_timeout,
                             header_timeout=args.header_timeout, max_connections=args.max_connections)
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # Ctrl-C is how a server is stopped: after a clean shutdown, not an error
            pass
    finally:
        sock.close()
    return 0
