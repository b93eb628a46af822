"""Serving: an OpenAI-compatible HTTP API with continuous batching, and a web playground.

``scheduler`` (continuous batching over the generation engine) needs only torch; ``server`` (the state
behind the handlers), ``sse`` (the streaming loop) and ``app`` (the routes) need the optional ``serve``
extra (fastapi, uvicorn), so import them only when serving. ``static/`` is the playground: plain HTML, CSS
and JavaScript (no build step) that talk to the API (``/props``, ``/apply-template``, ``/tokenize``, the
streamed chat completion's ``logprobs``, ``/v1/embeddings``).
"""

#: Largest request body the server reads (``serve --max-body-bytes``): a long prompt is ~100 KB of JSON.
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_SHUTDOWN_TIMEOUT = 10.0  # seconds from SIGTERM to exit (serve/http_server.py)
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds to send a request head, or each part of a body
DEFAULT_MAX_CONNECTIONS = 512
