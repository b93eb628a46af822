"""Serving: an OpenAI-compatible HTTP API with continuous batching, and a web playground.

``scheduler`` (continuous batching over the KV cache) needs only torch; ``app`` needs the optional
``serve`` extra (fastapi, uvicorn), so import it only when serving.
"""

#: Largest request body the server reads (``serve --max-body-bytes``): a long prompt is ~100 KB of JSON.
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
