"""Serving: an OpenAI-compatible HTTP API with continuous batching, and a web playground.

``scheduler`` (continuous batching over the KV cache) needs only torch; ``app`` needs the optional
``serve`` extra (fastapi, uvicorn), so import it only when serving.
"""
