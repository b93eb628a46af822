"""What the render limits cost: ChatTemplate.render against the same template in Jinja's plain sandbox.

    python benchmarks/bench_chat_template.py [--renders 500] [--rounds 7]

Two templates on one 12-message conversation: ChatML (one ``+`` chain per message, the template runs
trained here get) and a Llama-3-style template with three tools rendered by ``tojson(indent=4)``. The two
renderers alternate within each round; the table gives the median time per render over the rounds and the
range. Both must produce the same text (checked).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import string
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from jinja2.ext import loopcontrols  # noqa: E402
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402

from tinyformer.data.chat_template import CHATML_TEMPLATE, ChatTemplate  # noqa: E402
from tinyformer.data.tokenizer import build_tokenizer  # noqa: E402

LLAMA_STYLE = (
    "{{ bos_token }}{% if tools is not none %}<|start_header_id|>system<|end_header_id|>\n\n"
    "You may call these functions:\n{% for t in tools %}{{ t | tojson(indent=4) }}\n{% endfor %}<|eot_id|>"
    "{% endif %}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% if loop.last and add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    "{% endfor %}"
)
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": "a tool", "parameters": {
    "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}} for i in range(3)]
MESSAGES = [{"role": "system", "content": "You are terse."}] + [
    {"role": role, "content": f"message {i} " * 20} for i, role in zip(range(10), ["user", "assistant"] * 5)
] + [{"role": "user", "content": "last question"}]


def plain_sandbox(source: str):
    """The template in Jinja's sandbox with transformers' options and nothing else (no limits)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    return env.from_string(source)


def per_render_us(render, n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        render()
    return (time.perf_counter() - started) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--renders", type=int, default=500, help="renders per timing (default 500)")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds (default 7)")
    args = p.parse_args()
    tok = build_tokenizer("char", string.printable)
    print("| template | characters | Jinja sandbox, us | ChatTemplate, us | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, source, tools in (("ChatML", CHATML_TEMPLATE, None), ("Llama-3 style + 3 tools", LLAMA_STYLE, TOOLS)):
        tok.chat_template = source
        ours, raw = ChatTemplate(tok), plain_sandbox(source)
        variables = {"messages": MESSAGES, "tools": tools, "add_generation_prompt": True, "bos_token": tok.bos_token,
                     "eos_token": tok.eos_token, "pad_token": tok.pad_token}
        text = ours.render(MESSAGES, True, tools=tools)
        assert text == raw.render(**variables), "the two renderers disagree"
        times: dict[str, list[float]] = {"raw": [], "ours": []}
        render_raw = functools.partial(raw.render, **variables)
        render_ours = functools.partial(ours.render, MESSAGES, True, tools=tools)
        for _ in range(args.rounds):
            times["raw"].append(per_render_us(render_raw, args.renders))
            times["ours"].append(per_render_us(render_ours, args.renders))
        a, b = statistics.median(times["raw"]), statistics.median(times["ours"])
        print(f"| {name} | {len(text):,} | {a:.0f} ({min(times['raw']):.0f}-{max(times['raw']):.0f}) "
              f"| {b:.0f} ({min(times['ours']):.0f}-{max(times['ours']):.0f}) | {b / a:.2f} |")


if __name__ == "__main__":
    main()
