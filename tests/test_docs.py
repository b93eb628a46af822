"""The documentation is checked like code: every link, code reference, test reference and command.

Conventions the checker enforces in every markdown file under docs/ and in README.md:

* A relative link ``[text](path)`` or image ``![alt](path)`` must name an existing file or folder
  (relative to the markdown file); ``path#anchor`` into a markdown file must name one of its headings.
* A link to a Python file whose text is one code span naming a symbol, e.g.
  ``[`apply_rope`](../src/tinyformer/components/rope.py)`` or ``[`DecoderLM.forward`](...)``, must name
  a function, class, method or module-level name defined in that file (checked with ``ast``).
* A code span ``path::symbol`` (a pytest node id, path relative to the repository root), e.g.
  ``tests/components/test_rope.py::test_inv_freq_formula`` or ``src/tinyformer/components/rope.py::apply_rope``,
  must name a file and a symbol in it; ``[param]`` suffixes are allowed. A code span that is a repository
  path (``src/...``, ``tests/...``, ``benchmarks/...``, ``docs/...``, ``configs/...``) must exist.
* Every ``tinyformer ...`` (or ``python -m tinyformer ...``) command in a fenced ``bash``, ``sh``, ``shell``
  or ``console`` block is parsed by the real argument parser: an unknown subcommand or flag fails.
  ``python some/script.py`` must name an existing script. In ``console`` blocks commands start with ``$ ``
  and the lines after a command, up to the next ``$ ``, are its output.
* A block preceded by ``<!-- check -->`` is also run, and the output it shows must match (a line ``...``
  matches any number of lines). Only cheap commands may be run (``RUNNABLE``); training and the like
  stay parse-only. A block preceded by ``<!-- no-check -->`` is not looked at at all.
* Every ``python`` block of README.md and the walkthroughs is executed, the blocks of a page in order in one
  namespace, and a comment ``name = ...  # (2, 8, 256)`` ending in a shape is checked against
  ``name.shape``. A snippet that talks to ``http://127.0.0.1:8000`` runs against a real ``tinyformer``
  server (a tiny model named ``default``) on a free port. A block that cannot run in the tests says why in a
  marker before it: ``<!-- no-run: REASON -->``.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUNNABLE = {("tinyformer", "count")}  # (program, subcommand) pairs a `<!-- check -->` block may run
SHELL_LANGS = {"bash", "sh", "shell", "console"}
REPO_PREFIXES = ("src/", "tests/", "benchmarks/", "docs/", "configs/")

LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_SRC = re.compile(r"""<(?:img|a)\b[^>]*?\b(?:src|href)=["']([^"']+)["']""")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
NODE_REF = re.compile(r"^([\w./-]+\.py)::([\w.:\[\]-]+)$")
SYMBOL_TEXT = re.compile(r"^`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\(\))?`$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
NO_RUN = re.compile(r"<!-- no-run: \S.* -->")  # `<!-- no-run: needs a GPU -->` before a ```python block
#: the pages whose every ```python block the tests execute
PYTHON_PAGES = [ROOT / "README.md", DOCS / "walkthrough.md", DOCS / "walkthrough.zh.md"]


def doc_files() -> list[Path]:
    """Every markdown file the checker covers: docs/**/*.md and README.md when it exists."""
    files = sorted(DOCS.rglob("*.md")) if DOCS.is_dir() else []
    if (ROOT / "README.md").is_file():
        files.append(ROOT / "README.md")
    return files


# ---------------------------------------------------------------------------------------------- parsing


@dataclass
class Block:
    lang: str
    start: int  # line number (1-based) of the opening fence
    lines: list[str]
    marker: str | None  # "check", "no-check" or None


@dataclass
class Markdown:
    path: Path
    prose: list[tuple[int, str]] = field(default_factory=list)  # (line number, text) outside fenced blocks
    blocks: list[Block] = field(default_factory=list)


def parse_markdown(path: Path, text: str | None = None) -> Markdown:
    """The prose lines and fenced blocks of the markdown file ``path`` (or of ``text``, when given)."""
    md = Markdown(path)
    lines = (path.read_text(encoding="utf-8") if text is None else text).splitlines()
    i = 0
    last_marker: str | None = None
    while i < len(lines):
        line = lines[i]
        m = FENCE.match(line)
        if m:
            fence, lang = m.group(2), m.group(3).lower()
            body, j = [], i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                body.append(lines[j])
                j += 1
            md.blocks.append(Block(lang, i + 1, body, last_marker))
            last_marker = None
            i = j + 1
            continue
        stripped = line.strip()
        if stripped in ("<!-- check -->", "<!-- no-check -->"):
            last_marker = stripped[5:-4].strip()
        elif NO_RUN.fullmatch(stripped):  # a python block that cannot run in the tests, and why
            last_marker = "no-run"
        elif stripped:
            last_marker = None
        md.prose.append((i + 1, line))
        i += 1
    return md


def slugify(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links -> their text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in parse_markdown(path).prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = slugify(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    for _, line in parse_markdown(path).prose:  # explicit <a id="..."> / <a name="...">
        out.update(re.findall(r"""<a\s+(?:id|name)=["']([^"']+)["']""", line))
    return frozenset(out)


@cache
def defined_names(path: Path) -> dict[str, ast.AST]:
    """Dotted names defined in a Python file: functions, classes, their methods and nested classes, and
    module- or class-level assignments."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: dict[str, ast.AST] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[prefix + node.name] = node
                if isinstance(node, ast.ClassDef):
                    visit(node.body, prefix + node.name + ".")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names[prefix + n.id] = node
            elif isinstance(node, (ast.If, ast.Try)):  # definitions under `if TYPE_CHECKING:` / try-import
                visit(node.body, prefix)

    visit(tree.body, "")
    return names


def symbol_problem(path: Path, symbol: str) -> str | None:
    """None if ``symbol`` ('name', 'Class.method', 'Class::method', 'test_x[param]') is defined in ``path``."""
    if path.suffix != ".py":
        return f"{_rel(path)} is not a Python file, so it has no symbol {symbol!r}"
    name = re.sub(r"\[.*\]$", "", symbol).replace("::", ".")
    try:
        names = defined_names(path)
    except SyntaxError as exc:
        return f"{_rel(path)} does not parse: {exc}"
    if name not in names:
        return f"{_rel(path)} defines no {name!r}"
    return None


# ---------------------------------------------------------------------------------------------- checks


def check_links(md: Markdown) -> list[str]:
    problems = []
    here = md.path.parent
    for lineno, line in md.prose:
        targets = [(m.group(2), m.group(3)) for m in LINK.finditer(line)]
        targets += [("", t) for t in HTML_SRC.findall(line)]
        for text, target in targets:
            where = f"{_rel(md.path)}:{lineno}"
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ... (not fetched)
                continue
            path_part, _, anchor = target.partition("#")
            dest = (here / path_part).resolve() if path_part else md.path
            if not dest.exists():
                problems.append(f"{where}: broken link {target!r} (no {dest})")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: link {target!r} names no heading '#{anchor}' in {_rel(dest)}")
            sym = SYMBOL_TEXT.match(text.strip())
            if sym and dest.suffix == ".py" and not _names_the_file(sym.group(1), dest):
                problem = symbol_problem(dest, sym.group(1))
                if problem:
                    problems.append(f"{where}: link text {text} does not match the file: {problem}")
    return problems


def _names_the_file(text: str, path: Path) -> bool:
    """`rope` or `tinyformer.components.rope` for src/tinyformer/components/rope.py is the module itself."""
    parts = path.with_suffix("").parts
    dotted = text.split(".")
    return text.endswith(".py") or list(parts[-len(dotted):]) == dotted


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def check_code_references(md: Markdown) -> list[str]:
    """`path::symbol` node ids and `src/...`-style repository paths in code spans of the prose."""
    problems = []
    for lineno, line in md.prose:
        for m in CODE_SPAN.finditer(line):
            span = m.group(2).strip()
            where = f"{_rel(md.path)}:{lineno}"
            node = NODE_REF.match(span)
            if node:
                path = ROOT / node.group(1)
                if not path.is_file():
                    problems.append(f"{where}: {span!r} names a missing file {node.group(1)}")
                    continue
                problem = symbol_problem(path, node.group(2))
                if problem:
                    problems.append(f"{where}: {span!r}: {problem}")
            elif span.startswith(REPO_PREFIXES) and re.fullmatch(r"[\w./-]+", span) and "*" not in span:
                if not (ROOT / span).exists():
                    problems.append(f"{where}: {span!r} does not exist in the repository")
    return problems


@dataclass
class Command:
    argv: list[str]
    text: str
    lineno: int
    expected: list[str] | None  # console output shown under the command, if any


def block_commands(md: Markdown, block: Block) -> list[Command]:
    """The commands of a shell block, continuation lines joined, with the output shown under each."""
    commands: list[Command] = []
    console = block.lang == "console"
    pending, start = "", block.start
    for offset, raw in enumerate(block.lines, start=block.start + 1):
        if pending:  # the previous line ended with a backslash
            text = pending + " " + raw.strip()
        else:
            if console and not raw.startswith("$ "):
                if commands and commands[-1].expected is not None:
                    commands[-1].expected.append(raw)
                continue
            text = raw[2:].strip() if console else raw.strip().removeprefix("$ ")
            if not text or text.startswith("#"):
                continue
            start = offset
        if text.endswith("\\"):
            pending = text[:-1].rstrip()
            continue
        pending = ""
        try:
            argv = shlex.split(text, comments=True)
        except ValueError as exc:
            argv = ["<unparsable>", str(exc)]
        commands.append(Command(argv, text, start, [] if console else None))
    return commands


def command_segments(argv: list[str]) -> list[list[str]]:
    """Split a shell command at |, &&, ||, ; and drop leading VAR=value assignments."""
    segments, current = [], []
    for token in argv:
        if token in ("|", "&&", "||", ";"):
            segments.append(current)
            current = []
        else:
            current.append(token)
    segments.append(current)
    out = []
    for seg in segments:
        while seg and re.match(r"^[A-Za-z_]\w*=", seg[0]):
            seg = seg[1:]
        if seg:
            out.append(seg)
    return out


def tinyformer_args(segment: list[str]) -> list[str] | None:
    """The arguments after `tinyformer`, `python -m tinyformer` or `torchrun ... -m tinyformer`, else None."""
    if segment[0] == "tinyformer":
        return segment[1:]
    if segment[0] in ("python", "python3", "torchrun"):
        for i in range(1, len(segment) - 1):
            if segment[i] == "-m" and segment[i + 1] == "tinyformer":
                return segment[i + 2 :]
    return None


def parse_problem(args: list[str]) -> str | None:
    """None if the real `tinyformer` argument parser accepts ``args``, else its complaint."""
    from tinyformer.cli.main import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(args)
    except SystemExit as exc:
        if exc.code not in (0, None):  # --help exits 0
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
    return None


def run_in_process(args: list[str]) -> tuple[int, str]:
    from tinyformer.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue() + err.getvalue()


def output_matches(expected: list[str], actual: list[str]) -> bool:
    """Line by line after stripping trailing spaces; a line '...' matches any run of lines."""
    exp = [e.rstrip() for e in expected]
    act = [a.rstrip() for a in actual]
    while exp and not exp[-1]:
        exp.pop()
    while act and not act[-1]:
        act.pop()

    @cache
    def match(i: int, j: int) -> bool:
        if i == len(exp):
            return j == len(act)
        if exp[i] == "...":
            return any(match(i + 1, k) for k in range(j, len(act) + 1))
        return j < len(act) and exp[i] == act[j] and match(i + 1, j + 1)

    return match(0, 0)


def check_commands(md: Markdown, run: bool = True) -> list[str]:
    problems = []
    for block in md.blocks:
        if block.lang not in SHELL_LANGS or block.marker == "no-check":
            continue
        for cmd in block_commands(md, block):
            where = f"{_rel(md.path)}:{cmd.lineno}"
            segments = command_segments(cmd.argv)
            for seg in segments:
                args = tinyformer_args(seg)
                if args is not None:
                    problem = parse_problem(args)
                    if problem:
                        problems.append(f"{where}: `{cmd.text}` is not a valid command: {problem}")
                elif seg[0] in ("python", "python3") and len(seg) > 1 and seg[1].endswith(".py"):
                    if not (ROOT / seg[1]).is_file():
                        problems.append(f"{where}: `{cmd.text}`: script {seg[1]} does not exist")
            if block.marker != "check" or not run:
                continue
            if len(segments) != 1 or tinyformer_args(segments[0]) is None or \
                    ("tinyformer", (tinyformer_args(segments[0]) or [""])[0]) not in RUNNABLE:
                problems.append(f"{where}: `{cmd.text}` is in a <!-- check --> block but only "
                                f"{sorted(' '.join(r) for r in RUNNABLE)} may be run")
                continue
            code, output = run_in_process(tinyformer_args(segments[0]) or [])
            if code != 0:
                problems.append(f"{where}: `{cmd.text}` exited with {code}: {output.strip()[-300:]}")
            elif cmd.expected is not None and any(e.strip() for e in cmd.expected) \
                    and not output_matches(cmd.expected, output.splitlines()):
                problems.append(f"{where}: `{cmd.text}` printed something else than the doc shows:\n{output}")
    return problems


def check_file(path: Path, run: bool = True) -> list[str]:
    md = parse_markdown(path)
    return check_links(md) + check_code_references(md) + check_commands(md, run=run)


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: _rel(p))
def test_every_link_reference_and_command_in_the_docs_holds(path):
    problems = check_file(path)
    assert not problems, "\n".join(problems)


BAD_DOC = """# A page

See [`apply_rope`](../src/tinyformer/components/rope.py) and [the model](missing.md).
"""


def _write(tmp_path: Path, text: str) -> Path:
    """A markdown file at docs/<name>.md depth, so that ../src/... links resolve into this repository."""
    folder = tmp_path / "docs"
    folder.mkdir(exist_ok=True)
    path = folder / "page.md"
    path.write_text(text, encoding="utf-8")
    (tmp_path / "src").symlink_to(ROOT / "src", target_is_directory=True)
    return path


def test_link_checker_fails_on_a_broken_link(tmp_path):
    problems = check_file(_write(tmp_path, BAD_DOC))
    assert len(problems) == 1 and "broken link 'missing.md'" in problems[0]


def test_checker_catches_wrong_symbols_tests_anchors_commands_and_outputs(tmp_path):
    text = "\n".join([
        "# Title",
        "[`apply_rotary`](../src/tinyformer/components/rope.py)",  # symbol not in that file
        "[`RotaryEmbedding.forward`](../src/tinyformer/components/rope.py)",  # fine
        "`tests/components/test_rope.py::test_inv_freq_formula` and `tests/components/test_rope.py::test_no_such_test`",
        "`tests/test_no_such_file.py::test_x`",
        "[anchor](#title) and [bad anchor](#no-such-heading)",
        "`src/tinyformer/no_such_module.py`",
        "```bash",
        "tinyformer count --preset tiny --no-such-flag",
        "tinyformer no-such-command",
        "python benchmarks/no_such_script.py",
        "torchrun --nproc_per_node 2 -m tinyformer train --no-such-train-flag",
        "```",
        "<!-- check -->",
        "```console",
        "$ tinyformer count --preset llama-7b --json",
        '{"total_params": 7000000000}',
        "```",
        "<!-- check -->",
        "```bash",
        "tinyformer train --preset tiny",
        "```",
    ])
    problems = "\n".join(check_file(_write(tmp_path, text)))
    for needle in ("defines no 'apply_rotary'", "defines no 'test_no_such_test'", "test_no_such_file.py",
                   "no heading '#no-such-heading'", "no_such_module.py' does not exist", "--no-such-flag",
                   "no-such-command", "no_such_script.py does not exist", "printed something else",
                   "--no-such-train-flag",
                   "`tinyformer train --preset tiny` is in a <!-- check --> block"):
        assert needle in problems, needle
    for fine in ("RotaryEmbedding.forward", "test_inv_freq_formula", "'#title'"):
        assert fine not in problems, fine


def test_checker_accepts_matching_output_with_an_ellipsis(tmp_path):
    text = "\n".join([
        "<!-- check -->",
        "```console",
        "$ tinyformer count --preset gpt2-124m --seq-len 1024",
        "model: gpt2-124m  (d_model 768, 12 layers, 12 heads, 12 kv heads, d_ff 3072, vocab 50257)",
        "...",
        "  total                       124,439,808  (124.44M)",
        "...",
        "```",
    ])
    assert check_file(_write(tmp_path, text)) == []


def test_output_matching_ellipsis_rules():
    assert output_matches(["a", "...", "d"], ["a", "b", "c", "d"])
    assert output_matches(["a", "...", "b"], ["a", "b"])
    assert not output_matches(["a", "d"], ["a", "b", "d"])
    assert not output_matches(["a", "...", "e"], ["a", "b", "d"])


def python_modules() -> list[str]:
    """Module files under src/tinyformer, as paths relative to it (empty __init__.py files left out)."""
    pkg = ROOT / "src" / "tinyformer"
    return sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*.py")
                  if "__pycache__" not in p.parts and not (p.name == "__init__.py" and not p.read_text().strip()))


def test_architecture_mentions_every_module_and_only_existing_ones():
    doc = DOCS / "architecture.md"
    text = doc.read_text(encoding="utf-8")
    mapped = set(re.findall(r"^\| `([\w/]+\.py)` \|", text, re.MULTILINE))  # the module map: | `module` | concept |
    missing = [m for m in python_modules() if m not in mapped]
    assert not missing, f"docs/architecture.md's module map has no row for: {', '.join(missing)}"
    pkg = ROOT / "src" / "tinyformer"
    named = set(re.findall(r"`([\w/]+\.py)`", text))
    stale = sorted(n for n in named if not ((pkg / n).is_file() or (ROOT / n).is_file()))
    assert not stale, f"docs/architecture.md names files that do not exist: {', '.join(stale)}"


def _references(path: Path) -> tuple[set[str], set[str], set[str]]:
    """(link targets, code spans that are references, tinyformer commands) of a page."""
    md = parse_markdown(path)
    links, refs = set(), set()
    for _, line in md.prose:
        links.update(m.group(3) for m in LINK.finditer(line) if not m.group(3).startswith("#"))
        refs.update(m.group(2) for m in CODE_SPAN.finditer(line) if NODE_REF.match(m.group(2)))
    commands = {c.text for b in md.blocks if b.lang in SHELL_LANGS for c in block_commands(md, b)}
    return links, refs, commands


def test_chinese_walkthrough_has_the_same_links_tests_and_commands_as_the_english_one():
    en, zh = _references(DOCS / "walkthrough.md"), _references(DOCS / "walkthrough.zh.md")
    for kind, a, b in zip(("links", "test/code references", "commands"), en, zh):
        a = {x for x in a if x not in ("walkthrough.zh.md", "walkthrough.md")}
        b = {x for x in b if x not in ("walkthrough.zh.md", "walkthrough.md")}
        assert a == b, f"{kind} differ: only in English {sorted(a - b)}, only in Chinese {sorted(b - a)}"


# ---------------------------------------------------------------------------------------------- the walkthrough


def walkthrough_by_hand(model, ids):
    """docs/walkthrough.md's formulas written out step by step in float64, one head at a time, reading
    the model's weights by name: embedding, RMSNorm, Q/K/V, RoPE (half split), causal safe softmax, GQA,
    merge, W_o and residual, SwiGLU and residual, final RMSNorm, tied head. Returns logits (B, T, V)."""
    import torch

    cfg = model.cfg
    W = {k: v.detach().double() for k, v in model.state_dict().items()}
    B, T = ids.shape
    H, H_kv, d_h = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    half = d_h // 2

    def rmsnorm(x, g):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * g

    theta = torch.tensor([cfg.rope_theta ** (-2 * i / d_h) for i in range(half)], dtype=torch.float64)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * theta[None, :]  # (T, d_h/2): m * theta_i
    cos, sin = torch.cos(angle), torch.sin(angle)

    def rope(x):  # x (T, d_h); dimension i pairs with i + d_h/2
        a, b = x[:, :half], x[:, half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    h = W["tok_emb.weight"][ids]  # (B, T, d)
    for layer in range(cfg.n_layer):
        p = f"blocks.{layer}."
        x = rmsnorm(h, W[p + "attn_norm.weight"])
        w_qkv = W[p + "attn.qkv.weight"]
        w_q, w_k, w_v = w_qkv.split([H * d_h, H_kv * d_h, H_kv * d_h])
        q, k, v = x @ w_q.T, x @ w_k.T, x @ w_v.T
        heads = torch.zeros(B, T, H * d_h, dtype=torch.float64)
        for b in range(B):
            for i in range(H):
                g = i // (H // H_kv)  # the key/value head of query head i's group
                qi = rope(q[b, :, i * d_h : (i + 1) * d_h])
                kg = rope(k[b, :, g * d_h : (g + 1) * d_h])
                vg = v[b, :, g * d_h : (g + 1) * d_h]
                s = qi @ kg.T / d_h**0.5
                s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
                e = torch.exp(s - s.max(-1, keepdim=True).values)
                heads[b, :, i * d_h : (i + 1) * d_h] = (e / e.sum(-1, keepdim=True)) @ vg
        h = h + heads @ W[p + "attn.out.weight"].T
        x = rmsnorm(h, W[p + "ffn_norm.weight"])
        w_gate, w_up = W[p + "ffn.gate_up.weight"].split(cfg.d_ff)
        gate = x @ w_gate.T
        h = h + ((gate * torch.sigmoid(gate)) * (x @ w_up.T)) @ W[p + "ffn.down.weight"].T
    return rmsnorm(h, W["norm.weight"]) @ W["tok_emb.weight"].T


def test_walkthrough_formulas_written_out_give_the_models_logits():
    import torch

    from tinyformer.config import ModelConfig
    from tinyformer.models.decoder import DecoderLM

    # the walkthrough's example: B=2, T=8, d=64, H=4, H_kv=2 (GQA), d_h=16, d_ff=256, V=256
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=32)
    assert (cfg.head_dim, cfg.d_ff) == (16, 256)
    model = DecoderLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm gains, so a skipped gain cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(0, 256, (2, 8))
    want = walkthrough_by_hand(model, ids)
    with torch.no_grad():
        got64 = model.double()(ids)
    # (RoPE's cos/sin tables are computed in float32 even in a float64 model: hence 1e-8, not 1e-12)
    torch.testing.assert_close(got64, want, atol=1e-8, rtol=1e-6)
    assert want.abs().max() > 1e-2  # the comparison is not between two near-zero tensors


# ---------------------------------------------------------------------------------------------- corrections
#
# The walkthrough's "Corrections to common figures" section (<a id="corrections">, EN and ZH) states each
# right value on an indented fact line `    key: body` (the Chinese page: `    键：正文`, in Chinese, FACTS_ZH;
# both pages state the same figures in the same order), and every
# number on them is recomputed here: by `tinyformer count --json`, by the project's own modules, by the
# formula from the line's own inputs, or read from the experiment the walkthrough quotes. No expected
# number is typed in this file.

NUM = r"(-?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?)"
WORD = r"([\w.-]+)"
NORM_RESULTS = DOCS / "experiments" / "norm_placement.md"


@cache
def count_json(*args: str) -> dict:
    """What `tinyformer count <args> --json` prints, parsed."""
    import json

    code, out = run_in_process(["count", *args, "--json"])
    assert code == 0, out
    return json.loads(out)


@cache
def norm_placement_results() -> dict[tuple[str, str, str], dict[str, str]]:
    """The results table of docs/experiments/norm_placement.md: (run, layers, peak lr) -> column -> text."""
    rows = [r for r in NORM_RESULTS.read_text(encoding="utf-8").splitlines() if r.startswith("|")]
    head = [c.strip() for c in rows[0].strip("|").split("|")]
    out = {}
    for row in rows[2:]:
        cells = dict(zip(head, (c.strip() for c in row.strip("|").split("|"))))
        out[(cells["run"].removesuffix(" (6 layers)"), cells["layers"], cells["peak lr"])] = cells
    return out


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def shown_equals(shown: str, value: object) -> bool:
    """Does the text ``shown`` state ``value``: exactly for strings and integers, else to the precision shown
    (half a unit of its last decimal place)."""
    if isinstance(value, str):
        return shown == value
    mantissa, _, exponent = shown.replace(",", "").partition("e")
    if isinstance(value, int) and "." not in mantissa and not exponent:
        return int(mantissa) == value
    decimals = len(mantissa.partition(".")[2])
    tolerance = 0.5 * 10.0 ** (-decimals) * 10.0 ** int(exponent or 0)
    return abs(_number(shown) - float(value)) <= tolerance * (1 + 1e-9)


def _preset(name: str):
    from tinyformer.presets import get_preset

    return get_preset(name)


def _check_llama2_70b(g: list[str], facts: dict) -> list:
    from tinyformer.config import llama_ffn_hidden

    cfg, total = _preset("llama2-70b"), count_json("--preset", "llama2-70b")["total_params"]
    assert llama_ffn_hidden(cfg.d_model, cfg.ffn_dim_multiplier, cfg.ffn_multiple_of) == cfg.d_ff
    return [cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.d_ff, cfg.ffn_dim_multiplier, cfg.ffn_multiple_of,
            cfg.n_layer, total]


def _check_exp_limits(g: list[str], facts: dict) -> list:
    import math

    import torch

    f16, f32 = torch.finfo(torch.float16).max, torch.finfo(torch.float32).max
    return [f16, f16, math.log(f16), f32, f32, math.log(f32)]


def _layernorm_example(facts: dict) -> tuple[list[float], int]:
    xs = [_number(v) for v in re.findall(NUM, facts["layernorm x"][0].partition("]")[0])]
    return xs, len(xs)


def _layernorm(facts: dict, gamma: float, beta: float) -> list[float]:
    """The project's LayerNorm (eps 0) on the example."""
    import torch

    from tinyformer.components.norm import LayerNorm

    xs, d = _layernorm_example(facts)
    ln = LayerNorm(d, eps=0.0).double()
    with torch.no_grad():
        ln.weight.fill_(gamma)
        ln.bias.fill_(beta)
        return ln(torch.tensor(xs, dtype=torch.float64)).tolist()


def _check_layernorm_x(g: list[str], facts: dict) -> list:
    xs, d = _layernorm_example(facts)
    mean = sum(xs) / d
    return [*g[:4], d, mean, sum((v - mean) ** 2 for v in xs) / d]  # the inputs, then the biased variance


def _check_layernorm_deviations(g: list[str], facts: dict) -> list:
    xs, d = _layernorm_example(facts)
    deviations = [v - sum(xs) / d for v in xs]
    squares = sum(v * v for v in deviations)
    return [*deviations, squares, squares / (d - 1)]


def _check_layernorm_normalised(g: list[str], facts: dict) -> list:
    return _layernorm(facts, 1.0, 0.0)


def _check_layernorm_output(g: list[str], facts: dict) -> list:
    return [*g[:2], *_layernorm(facts, _number(g[0]), _number(g[1]))]


def _check_layernorm_parameters(g: list[str], facts: dict) -> list:
    from tinyformer.components.norm import LayerNorm

    _, d = _layernorm_example(facts)
    return [sum(p.numel() for p in LayerNorm(d).parameters())]


def _check_score_memory(g: list[str], facts: dict) -> list:
    batch, heads, seq = (_number(v) for v in g[:3])
    args = ("--preset", "llama-7b", "--batch", g[0], "--seq-len", g[2])
    bf16 = count_json(*args, "--dtype", "bfloat16")["attention_memory"]
    f32 = count_json(*args, "--dtype", "float32")["attention_memory"]
    assert batch * heads * seq**2 * 2 == bf16["naive_scores_bytes_per_layer"]  # the formula the line states
    return [g[0], _preset("llama-7b").n_head, g[2], bf16["naive_scores_bytes_per_layer"],
            f32["naive_scores_bytes_per_layer"], f32["sdpa_bytes_per_layer"]]


def _check_tying(g: list[str], facts: dict) -> list:
    from tinyformer.sizing import count_params

    cfg, report = _preset("llama-7b"), count_json("--preset", "llama-7b")
    untied = report["total_params"]
    saved = untied - count_params(cfg.replace(tie_embeddings=True)).total
    assert saved == report["params"]["head"]  # what tying removes is the head matrix
    return [cfg.vocab_size, cfg.d_model, saved, 100 * saved / untied, untied]


def _check_activations(g: list[str], facts: dict) -> list:
    return [g[0], _preset(g[0]).ffn, g[2], _preset(g[2]).ffn, g[4], _preset(g[4]).ffn]


def _check_residual_factors(g: list[str], facts: dict) -> list:
    depth = _preset("gpt3-175b").n_layer
    return [g[0], depth, _number(g[0]) ** depth, g[3], depth, _number(g[3]) ** depth]


def _check_rope_last_pair(g: list[str], facts: dict) -> list:
    from tinyformer.components.rope import default_inv_freq

    base = _preset("llama-7b").rope_theta
    expected: list = [base]
    for d_h in (_number(g[1]), _number(g[3])):
        inv = default_inv_freq(int(d_h), base).double()
        expected += [int(d_h), float(inv[0] / inv[-1])]
    return expected


def _check_grad_norms(g: list[str], facts: dict) -> list:
    pre = norm_placement_results()[("pre-norm, no warm-up", "24", "0.001")]["grad norm at init, blocks 1 / 2 / last"]
    post = norm_placement_results()[("post-norm, no warm-up", "24", "0.001")]["grad norm at init, blocks 1 / 2 / last"]
    return [*pre.split(" / "), *post.split(" / ")]


def _warm_up_checker(placement: str, layers: str):
    """Validation losses with and without warm-up, per peak lr, from the experiment's results table."""
    def check(g: list[str], facts: dict) -> list:
        out = []
        for lr in g[0::3]:
            out += [lr] + [norm_placement_results()[(f"{placement}, {w}", layers, lr)]["val loss"]
                           for w in ("warm-up 60", "no warm-up")]
        return out

    return check


def _check_llama2_70b_layer(g: list[str], facts: dict) -> list:
    p = count_json("--preset", "llama2-70b")["params"]
    assert p["per_layer"] == p["attention_per_layer"] + p["ffn_per_layer"] + p["norms_per_layer"]
    # the slip's own figure (201M a block) times the real depth
    return [p["per_layer"], p["attention_per_layer"], p["ffn_per_layer"], p["norms_per_layer"], p["n_layer"],
            p["all_layers"], 201, p["n_layer"], 201e6 * p["n_layer"] / 1e9]


def _check_llama_7b_sum(g: list[str], facts: dict) -> list:
    report = count_json("--preset", "llama-7b")
    p = report["params"]
    without_head = p["n_layer"] * p["per_layer"] + p["embedding"]
    assert without_head + p["head"] + p["final_norm"] == report["total_params"]
    return [p["n_layer"], p["per_layer"], p["embedding"], without_head, p["head"], p["final_norm"],
            report["total_params"]]


def _check_score_memory_128k(g: list[str], facts: dict) -> list:
    seq = 128_000  # "128K" as the figure uses it; 2^17 = 131,072 is the other reading
    scores = count_json("--preset", "llama-7b", "--seq-len", str(seq), "--dtype", "float32")["attention_memory"]
    per_head = scores["naive_scores_bytes_per_layer"] // _preset("llama-7b").n_head
    assert per_head == seq**2 * 4
    return [seq, per_head, per_head / 2**30, per_head / 1e9, per_head / 2 / 2**30, 2**17, 2**34 * 4 / 2**30]


@cache
def _gpt3_banded() -> tuple[int, int]:
    """(layers, parameters) of gpt3-175b with every other layer banded; asserts the count is the dense one."""
    from tinyformer.sizing import count_params

    cfg = _preset("gpt3-175b")
    banded = cfg.replace(layer_types=["full", "sliding"] * (cfg.n_layer // 2), sliding_window=256)
    total = count_params(banded).total
    assert total == count_params(cfg).total == count_json("--preset", "gpt3-175b")["total_params"]
    return cfg.n_layer, total


def _check_gpt3_attention(g: list[str], facts: dict) -> list:
    layers, total = _gpt3_banded()
    return [layers, layers // 2, layers // 2, total, layers]


def _check_sinusoidal_entry(g: list[str], facts: dict) -> list:
    import inspect

    from tinyformer.components.positions import sinusoidal_table

    d, pos, i = (int(_number(v)) for v in g[:3])
    base = inspect.signature(sinusoidal_table).parameters["base"].default
    table = sinusoidal_table(pos + 1, d)
    return [d, pos, i, pos, 2 * i, pos, base, 2 * i, d, float(table[pos, 2 * i]),
            pos, 2 * i + 1, pos, base, 2 * i, d, float(table[pos, 2 * i + 1])]


def _check_llama2_heads(g: list[str], facts: dict) -> list:
    out: list = []
    for name in ("llama2-7b", "llama2-13b", "llama2-70b"):
        cfg = _preset(name)
        out += [name, cfg.n_head, cfg.n_kv_head]
    return out


def _check_swiglu(g: list[str], facts: dict) -> list:
    from tinyformer.sizing.params import ffn_params

    cfg = _preset("llama-7b")
    assert ffn_params(cfg) == count_json("--preset", "llama-7b")["params"]["ffn_per_layer"]
    return [3, cfg.d_model, cfg.d_ff, ffn_params(cfg), 2 * cfg.d_model * cfg.d_ff]


@cache
def _layer_flops(n: int, d: int, k: int) -> dict[str, int]:
    from test_walkthrough_slips import layer_flops  # FLOPs of real modules, counted by PyTorch

    return layer_flops(n, d, k)


def _check_layer_flops(g: list[str], facts: dict) -> list:
    n, d, k = (int(_number(v)) for v in g[:3])
    f = _layer_flops(n, d, k)
    assert (f["convolution"], f["recurrence"], f["self-attention"], f["projections"]) == (
        2 * k * n * d * d, 4 * n * d * d, 4 * n * n * d, 8 * n * d * d)  # the formulas the line states
    return [n, d, k, f["convolution"], f["recurrence"], f["self-attention"], f["projections"]]


# key -> (the body's pattern, the values its groups must state)
FACTS = {
    "llama2-70b": (rf"d_model {NUM}, n_head {NUM}, n_kv_head {NUM}, d_ff {NUM} \(8 d/3 x {NUM}, rounded up to "
                   rf"a multiple of {NUM}\), n_layer {NUM}, total {NUM}", _check_llama2_70b),
    "exp limits": (rf"float16 max {NUM}, ln\({NUM}\) = {NUM}; float32 max {NUM}, ln\({NUM}\) = {NUM}",
                   _check_exp_limits),
    "layernorm x": (rf"\[{NUM}, {NUM}, {NUM}, {NUM}\], d = {NUM}, mean {NUM}, variance {NUM} "
                    r"\(squared deviations summed, divided by d\)", _check_layernorm_x),
    "layernorm deviations": (rf"\[{NUM}, {NUM}, {NUM}, {NUM}\], squares summed {NUM}; divided by d - 1: {NUM}",
                             _check_layernorm_deviations),
    "layernorm normalised": (rf"\[{NUM}, {NUM}, {NUM}, {NUM}\]", _check_layernorm_normalised),
    "layernorm output": (rf"gamma {NUM}, beta {NUM}: \[{NUM}, {NUM}, {NUM}, {NUM}\]", _check_layernorm_output),
    "layernorm parameters": (rf"gamma and beta, 2 d = {NUM}", _check_layernorm_parameters),
    "score memory": (rf"B {NUM}, H {NUM}, T {NUM}: B H T\^2 x 2 bytes \(bfloat16\) = {NUM}, "
                     rf"x 4 bytes \(float32\) = {NUM}; SDPA keeps B H T x 4 = {NUM} bytes", _check_score_memory),
    "weight tying": (rf"V {NUM} x d {NUM} = {NUM} parameters saved, {NUM}% of {NUM}", _check_tying),
    "ffn activation": (rf"{WORD} {WORD}, {WORD} {WORD}, {WORD} {WORD}", _check_activations),
    "residual factors": (rf"{NUM}\^{NUM} = {NUM}, {NUM}\^{NUM} = {NUM}", _check_residual_factors),
    "rope last pair": (rf"base\^\(-\(d_h - 2\)/d_h\), base {NUM}: d_h = {NUM}: 1/{NUM}, d_h = {NUM}: 1/{NUM}",
                       _check_rope_last_pair),
    "grad norm at init": (rf"pre-norm {NUM} / {NUM} / {NUM}, post-norm {NUM} / {NUM} / {NUM} "
                          r"\(24 layers, blocks 1 / 2 / 24\)", _check_grad_norms),
    "warm-up post-norm 24 layers": (rf"lr {NUM}: {NUM} with, {NUM} without; lr {NUM}: {NUM} with, {NUM} without",
                                    _warm_up_checker("post-norm", "24")),
    "warm-up post-norm 6 layers": (rf"lr {NUM}: {NUM} with, {NUM} without; lr {NUM}: {NUM} with, {NUM} without",
                                   _warm_up_checker("post-norm", "6")),
    "warm-up pre-norm 24 layers": (rf"lr {NUM}: {NUM} with, {NUM} without; lr {NUM}: {NUM} with, {NUM} without",
                                   _warm_up_checker("pre-norm", "24")),
    "llama2-70b layer": (rf"{NUM} = attention {NUM} \+ FFN {NUM} \+ norms {NUM}; {NUM} layers: {NUM}; "
                         rf"{NUM}M x {NUM} = {NUM}B", _check_llama2_70b_layer),
    "llama-7b sum": (rf"{NUM} x {NUM} \+ embedding {NUM} = {NUM}; \+ head {NUM} \+ final norm {NUM} = {NUM}",
                     _check_llama_7b_sum),
    "score memory 128K": (rf"T {NUM}: T\^2 x 4 bytes = {NUM} = {NUM} GiB = {NUM} GB per head and layer; "
                          rf"x 2 bytes \(float16\) = {NUM} GiB; T {NUM}: {NUM} GiB", _check_score_memory_128k),
    "gpt-3 attention": (rf"{NUM} layers, {NUM} dense and {NUM} banded: {NUM} parameters, as with {NUM} dense layers",
                        _check_gpt3_attention),
    "sinusoidal entry": (rf"d {NUM}, pos {NUM}, pair i {NUM}: "
                         rf"PE\[{NUM}, {NUM}\] = sin\({NUM} / {NUM}\^\({NUM}/{NUM}\)\) = {NUM}, "
                         rf"PE\[{NUM}, {NUM}\] = cos\({NUM} / {NUM}\^\({NUM}/{NUM}\)\) = {NUM}",
                         _check_sinusoidal_entry),
    "llama-2 heads": (rf"{WORD} {NUM} query {NUM} kv, {WORD} {NUM} query {NUM} kv, {WORD} {NUM} query {NUM} kv",
                      _check_llama2_heads),
    "swiglu llama-7b": (rf"{NUM} x d {NUM} x d_ff {NUM} = {NUM}; two matrices of the same d_ff: {NUM}", _check_swiglu),
    "layer flops": (rf"n {NUM}, d {NUM}, k {NUM}: convolution 2 k n d\^2 = {NUM}, recurrence 4 n d\^2 = {NUM}, "
                    rf"self-attention 4 n\^2 d = {NUM}; its projections 8 n d\^2 = {NUM}", _check_layer_flops),
}
TOTAL = re.compile(r"^total ([\w.-]+)$")  # `    total llama2-13b: 13,015,864,320`

# The Chinese page's fact lines say the same in Chinese: key -> (its Chinese key, the pattern of its body, with
# the same groups in the same order, so that FACTS' checks read them unchanged). Key and body are separated
# by a full-width colon there.
FACTS_ZH = {
    "llama2-70b": ("llama2-70b 形状", rf"d_model {NUM}，n_head {NUM}，n_kv_head {NUM}，d_ff {NUM}（8 d/3 x {NUM}，"
                                      rf"向上取整到 {NUM} 的倍数），n_layer {NUM}，总参数 {NUM}"),
    "exp limits": ("exp 的上限", rf"float16 最大值 {NUM}，ln\({NUM}\) = {NUM}；float32 最大值 {NUM}，"
                                 rf"ln\({NUM}\) = {NUM}"),
    "layernorm x": ("layernorm 输入", rf"\[{NUM}, {NUM}, {NUM}, {NUM}\]，d = {NUM}，均值 {NUM}，方差 {NUM}"
                                      r"（偏差的平方和除以 d）"),
    "layernorm deviations": ("layernorm 偏差", rf"\[{NUM}, {NUM}, {NUM}, {NUM}\]，平方和 {NUM}；除以 d - 1：{NUM}"),
    "layernorm normalised": ("layernorm 归一化后", rf"\[{NUM}, {NUM}, {NUM}, {NUM}\]"),
    "layernorm output": ("layernorm 输出", rf"gamma {NUM}，beta {NUM}：\[{NUM}, {NUM}, {NUM}, {NUM}\]"),
    "layernorm parameters": ("layernorm 参数", rf"gamma 和 beta，2 d = {NUM}"),
    "score memory": ("分数的内存", rf"B {NUM}，H {NUM}，T {NUM}：B H T\^2 x 2 字节（bfloat16）= {NUM}，"
                                   rf"x 4 字节（float32）= {NUM}；SDPA 只存 B H T x 4 = {NUM} 字节"),
    "weight tying": ("权重绑定", rf"V {NUM} x d {NUM} = 省下 {NUM} 个参数，占 {NUM}%（共 {NUM} 个）"),
    "ffn activation": ("FFN 的激活函数", rf"{WORD} 用 {WORD}，{WORD} 用 {WORD}，{WORD} 用 {WORD}"),
    "residual factors": ("残差系数", rf"{NUM}\^{NUM} = {NUM}，{NUM}\^{NUM} = {NUM}"),
    "rope last pair": ("RoPE 最慢的一对", rf"base\^\(-\(d_h - 2\)/d_h\)，base {NUM}：d_h = {NUM} 时为 1/{NUM}，"
                                         rf"d_h = {NUM} 时为 1/{NUM}"),
    "grad norm at init": ("初始化时的梯度范数", rf"pre-norm {NUM} / {NUM} / {NUM}，post-norm {NUM} / {NUM} / {NUM}"
                                               r"（24 层，第 1 / 2 / 24 块）"),
    "warm-up post-norm 24 layers": ("预热 post-norm 24 层",
                                    rf"lr {NUM}：有预热 {NUM}，无预热 {NUM}；lr {NUM}：有预热 {NUM}，无预热 {NUM}"),
    "warm-up post-norm 6 layers": ("预热 post-norm 6 层",
                                   rf"lr {NUM}：有预热 {NUM}，无预热 {NUM}；lr {NUM}：有预热 {NUM}，无预热 {NUM}"),
    "warm-up pre-norm 24 layers": ("预热 pre-norm 24 层",
                                   rf"lr {NUM}：有预热 {NUM}，无预热 {NUM}；lr {NUM}：有预热 {NUM}，无预热 {NUM}"),
    "llama2-70b layer": ("llama2-70b 每层", rf"{NUM} = 注意力 {NUM} \+ FFN {NUM} \+ 归一化 {NUM}；{NUM} 层：{NUM}；"
                                            rf"{NUM}M x {NUM} = {NUM}B"),
    "llama-7b sum": ("llama-7b 的加法", rf"{NUM} x {NUM} \+ 词嵌入 {NUM} = {NUM}；"
                                        rf"\+ 输出头 {NUM} \+ 最终归一化 {NUM} = {NUM}"),
    "score memory 128K": ("128K 上下文的分数内存",
                          rf"T {NUM}：T\^2 x 4 字节 = {NUM} = {NUM} GiB = {NUM} GB，每个头每层；"
                          rf"x 2 字节（float16）= {NUM} GiB；T {NUM}：{NUM} GiB"),
    "gpt-3 attention": ("GPT-3 的注意力", rf"{NUM} 层，{NUM} 层稠密、{NUM} 层带状：{NUM} 个参数，"
                                          rf"与 {NUM} 层全稠密相同"),
    "sinusoidal entry": ("正弦位置编码的一项", rf"d {NUM}，pos {NUM}，维度对 i {NUM}："
                                               rf"PE\[{NUM}, {NUM}\] = sin\({NUM} / {NUM}\^\({NUM}/{NUM}\)\) = {NUM}，"
                                               rf"PE\[{NUM}, {NUM}\] = cos\({NUM} / {NUM}\^\({NUM}/{NUM}\)\) = {NUM}"),
    "llama-2 heads": ("LLaMA-2 的头数", rf"{WORD} 有 {NUM} 个查询头、{NUM} 个 kv 头，{WORD} 有 {NUM} 个查询头、"
                                        rf"{NUM} 个 kv 头，{WORD} 有 {NUM} 个查询头、{NUM} 个 kv 头"),
    "swiglu llama-7b": ("llama-7b 的 SwiGLU", rf"{NUM} x d {NUM} x d_ff {NUM} = {NUM}；同样 d_ff 的两个矩阵：{NUM}"),
    "layer flops": ("一层的 FLOPs", rf"n {NUM}，d {NUM}，k {NUM}：卷积 2 k n d\^2 = {NUM}，循环 4 n d\^2 = {NUM}，"
                                    rf"自注意力 4 n\^2 d = {NUM}；它的投影 8 n d\^2 = {NUM}"),
}
TOTAL_ZH = re.compile(r"^参数总数 ([\w.-]+)$")  # `    参数总数 llama2-13b：13,015,864,320`
ZH_KEYS = {zh: key for key, (zh, _) in FACTS_ZH.items()}
SEPARATOR = {"en": ": ", "zh": "："}


def read_fact(line: str, lang: str) -> tuple[str | None, str]:
    """(the fact's key in FACTS, or ``total <preset>``; None when the line names no known fact, its body)."""
    key, sep, body = line.strip().partition(SEPARATOR[lang])
    total = (TOTAL if lang == "en" else TOTAL_ZH).match(key)
    if not sep:
        return None, body
    if total:
        return f"total {total.group(1)}", body
    key = key if lang == "en" else ZH_KEYS.get(key, "")
    return (key if key in FACTS else None), body


def fact_pattern(key: str, lang: str) -> str:
    return FACTS[key][0] if lang == "en" else FACTS_ZH[key][1]


def corrections_section(text: str) -> list[str]:
    """The lines from <a id="corrections"> to the next level-2 heading."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if '<a id="corrections"></a>' in line)
    heading = next(i for i in range(start, len(lines)) if lines[i].startswith("## "))
    end = next((i for i in range(heading + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def fact_lines(section: list[str]) -> list[str]:
    return [line for line in section if line.startswith("    ") and line.strip()]


def fact_problems(section: list[str], lang: str = "en") -> list[str]:
    """Everything wrong with the fact lines of a corrections section (empty when every number holds);
    ``lang`` "zh" reads them as the Chinese page writes them (FACTS_ZH)."""
    problems, facts = [], {}
    for line in fact_lines(section):
        key, body = read_fact(line, lang)
        if key is None:
            problems.append(f"not a known fact line: {line.strip()!r}")
        elif key in facts:
            problems.append(f"fact {key!r} stated twice")
        else:
            facts[key] = [body]
    problems += [f"missing fact line {key!r}" for key in FACTS if key not in facts]
    for key, (body,) in facts.items():
        total = TOTAL.match(key)
        pattern, check = (NUM, None) if total else (fact_pattern(key, lang), FACTS[key][1])
        m = re.fullmatch(pattern, body)
        if not m:
            problems.append(f"{key}: {body!r} does not read as {pattern!r}")
            continue
        try:
            want = [count_json("--preset", total.group(1))["total_params"]] if total else check(list(m.groups()), facts)
        except Exception as exc:  # a mistyped input (an unknown preset, a missing table row) is a problem too
            problems.append(f"{key}: cannot recompute {body!r}: {exc!r}")
            continue
        wrong = [(s, w) for s, w in zip(m.groups(), want) if not shown_equals(s, w)]
        if wrong or len(want) != len(m.groups()):
            problems.append(f"{key}: the doc states {wrong or m.groups()}, the code computes {want}")
    return problems


WALKTHROUGHS = [DOCS / "walkthrough.md", DOCS / "walkthrough.zh.md"]


LANG = {"walkthrough.md": "en", "walkthrough.zh.md": "zh"}


@pytest.mark.parametrize("path", WALKTHROUGHS, ids=lambda p: p.name)
def test_corrections_section_states_what_count_the_code_and_the_experiments_compute(path):
    section = corrections_section(path.read_text(encoding="utf-8"))
    problems = fact_problems(section, LANG[path.name])
    assert not problems, "\n".join(problems)


def stated_facts(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(key, the figures as written) of each fact line of a page, in order."""
    lang = LANG[path.name]
    out = []
    for line in fact_lines(corrections_section(path.read_text(encoding="utf-8"))):
        key, body = read_fact(line, lang)
        pattern = NUM if key.startswith("total ") else fact_pattern(key, lang)
        out.append((key, re.fullmatch(pattern, body).groups()))
    return out


def test_corrections_fact_lines_state_the_same_figures_in_english_and_chinese():
    assert set(FACTS_ZH) == set(FACTS)
    en, zh = (stated_facts(p) for p in WALKTHROUGHS)
    assert en == zh


# the words of the English fact lines that are prose, not a name or a symbol: none may stay on the Chinese page
ENGLISH_PROSE = {"rounded", "multiple", "max", "mean", "variance", "squared", "deviations", "summed", "divided",
                 "squares", "and", "bytes", "keeps", "parameters", "saved", "of", "per", "head", "layer", "layers",
                 "with", "without", "attention", "norms", "embedding", "final", "dense", "banded", "as", "pair",
                 "query", "two", "matrices", "the", "same", "convolution", "recurrence", "self", "its", "projections",
                 "blocks", "total"}


def test_the_chinese_fact_lines_are_written_in_chinese():
    lines = fact_lines(corrections_section((DOCS / "walkthrough.zh.md").read_text(encoding="utf-8")))
    english = {line.strip(): words for line in lines
               if (words := set(re.findall(r"[A-Za-z_]+", line)) & ENGLISH_PROSE)}
    assert not english, english
    assert all(re.search(r"[\u4e00-\u9fff]", line) for line in lines)


def test_corrections_totals_cover_every_preset_the_walkthrough_runs_and_are_asserted_by_test_sizing():
    from test_sizing import PUBLISHED  # the published totals tests/sizing/test_sizing.py asserts

    text = (DOCS / "walkthrough.md").read_text(encoding="utf-8")
    totals = {TOTAL.match(line.strip().partition(": ")[0]).group(1)
              for line in fact_lines(corrections_section(text)) if TOTAL.match(line.strip().partition(": ")[0])}
    # moe is tinyformer's own shape, with no published total: tests/sizing/test_sizing.py counts it against
    # transformers' Mixtral built from the same values
    assert set(re.findall(r"--preset ([\w.-]+)", text)) - {"moe"} <= totals
    # bert-base and transformer-base: tests/sizing/test_classic_sizing.py
    assert totals <= set(PUBLISHED) | {"bert-base", "transformer-base"}


@pytest.mark.parametrize("path", WALKTHROUGHS, ids=lambda p: p.name)
def test_every_logarithm_and_power_written_in_the_walkthrough_holds(path):
    """`ln(A) = B` and `A^N = B` in the prose too (section 7 repeats the exp limits), to the digits shown."""
    import math

    text = path.read_text(encoding="utf-8")
    stated = [(m.group(0), math.log(_number(m.group(1))), m.group(2))
              for m in re.finditer(rf"ln\({NUM}\) = {NUM}", text)]
    stated += [(m.group(0), _number(m.group(1)) ** _number(m.group(2)), m.group(3))
               for m in re.finditer(rf"(?<![\w.]){NUM}\^{NUM} = {NUM}", text)]
    assert len(stated) >= 6
    wrong = [claim for claim, value, shown in stated if not shown_equals(shown, value)]
    assert not wrong, wrong


@pytest.mark.parametrize("path", WALKTHROUGHS, ids=lambda p: p.name)
def test_a_wrong_digit_anywhere_on_a_fact_line_is_caught(path):
    """Each digit run of each fact line, changed by one in its last digit, makes the check fail."""
    lang = LANG[path.name]
    section = corrections_section(path.read_text(encoding="utf-8"))
    assert not fact_problems(section, lang)
    fact_index = [i for i, line in enumerate(section) if line in fact_lines(section)]
    mutants = 0
    for i in fact_index:
        for m in re.finditer(r"\d+", section[i]):
            last = m.end() - 1
            digit = str((int(section[i][last]) + 1) % 10)
            mutated = [*section[:i], section[i][:last] + digit + section[i][last + 1 :], *section[i + 1 :]]
            assert fact_problems(mutated, lang), f"changing {m.group()!r} in {section[i].strip()!r} went unnoticed"
            mutants += 1
    assert mutants > 50


# ---------------------------------------------------------------------------------------------- section 0: tokens
TOKEN_EXAMPLES = DOCS / "examples" / "zh"
# the figures of section 0, per page: key -> pattern; each NUM group is recomputed by tokens_section_problems
TOKEN_FIGURES = {
    "walkthrough.md": {
        "default": rf"default tokenizer on attention\.txt: {NUM} tokens per character",
        "trained": rf"tokenizer trained on docs/examples/zh: {NUM} characters per token on attention\.txt "
                   rf"\({NUM} tokens per character\)",
        "measured chars": rf"\({NUM} characters, a few of them ASCII\)",
        "corpus chars": rf"\({NUM} characters; a real corpus",
    },
    "walkthrough.zh.md": {
        "default": rf"默认分词器切 attention\.txt：每字符 {NUM} 个词元",
        "trained": rf"在 docs/examples/zh 上训练的分词器：attention\.txt 上每个词元 {NUM} 个字符"
                   rf"（每字符 {NUM} 个词元）",
        "measured chars": rf"（{NUM} 个字符，\s*其中少数是 ASCII）",
        "corpus chars": rf"（{NUM} 个字符；真正的语料",
    },
}


def tokens_section(text: str) -> str:
    """Section 0 of a walkthrough, from its heading to the next level-2 heading."""
    start = text.index("\n## 0. ")
    return text[start : text.index("\n## ", start + 1)]


@cache
def recipe_tokenizer(data: str | None, vocab_size: int | None) -> Path:
    """A folder holding the tokenizer `tinyformer train` trains for ``--data`` and ``--vocab-size`` (the
    trainer's own train_tokenizer)."""
    import tempfile

    from tinyformer.training.prepare import train_tokenizer
    from tinyformer.training.train_config import TrainConfig

    folder = Path(tempfile.mkdtemp(prefix="recipe-tokenizer-"))
    train_tokenizer(TrainConfig(data=data, vocab_size=vocab_size)).save(folder)
    return folder


def section_tokenizers(text: str) -> dict[str, Path]:
    """runs/NAME -> the tokenizer of each `tinyformer train ... --out runs/NAME` command in ``text``, trained
    with the --data and --vocab-size the command gives."""
    runs = {}
    for m in re.finditer(r"^\$ tinyformer train (.*)$", text, re.M):
        flags = dict(re.findall(r"--([\w-]+) (\S+)", m.group(1)))
        data = str(ROOT / flags["data"]) if "data" in flags else None
        runs[flags["out"]] = recipe_tokenizer(data, int(flags["vocab-size"]) if "vocab-size" in flags else None)
    return runs


def tokens_section_problems(page: str, section: str) -> list[str]:
    """What section 0 states that the tokenizers its commands train do not give: each `tinyformer tokenize`
    output shown, and each figure of TOKEN_FIGURES."""
    from tinyformer.cli.tokenize import summary
    from tinyformer.data.tokenizer import Tokenizer

    problems = []
    runs = section_tokenizers(section)
    if set(runs) != {"runs/en", "runs/zh"}:
        return [f"section 0 trains {sorted(runs)}, not runs/en and runs/zh"]
    md = parse_markdown(Path(page), section)
    shown = 0
    for block in md.blocks:
        for command in block_commands(md, block):
            if command.argv[:2] != ["tinyformer", "tokenize"]:
                continue
            args = [str(runs[a]) if a in runs else a for a in command.argv[1:]]
            code, out = run_in_process(args)
            shown += 1
            if code != 0 or not output_matches(command.expected or [], out.splitlines()):
                problems.append(f"`{command.text}` prints\n{out}")
    if shown < 3:
        problems.append(f"section 0 shows {shown} tokenize outputs, not 3")
    measured = (TOKEN_EXAMPLES / "attention.txt").read_text(encoding="utf-8")
    corpus = sum(len(p.read_text(encoding="utf-8")) for p in sorted(TOKEN_EXAMPLES.glob("*.txt")))
    en, zh = (summary(measured, len(Tokenizer.load(runs[r]).encode(measured))) for r in ("runs/en", "runs/zh"))
    want = {"default": [en["tokens_per_character"]], "trained": [zh["characters_per_token"],
                                                              zh["tokens_per_character"]],
            "measured chars": [len(measured)], "corpus chars": [corpus]}
    for key, pattern in TOKEN_FIGURES[Path(page).name].items():
        m = re.search(pattern, section)
        if not m:
            problems.append(f"{key}: no line reads as {pattern!r}")
        elif not all(shown_equals(s, w) for s, w in zip(m.groups(), want[key])):
            problems.append(f"{key}: the doc states {m.groups()}, the tokenizers give {want[key]}")
    return problems


@pytest.mark.parametrize("path", WALKTHROUGHS, ids=lambda p: p.name)
def test_tokens_section_shows_what_the_default_and_the_chinese_tokenizers_give(path):
    problems = tokens_section_problems(str(path), tokens_section(path.read_text(encoding="utf-8")))
    assert not problems, "\n".join(problems)


def test_a_wrong_digit_in_the_tokens_section_is_caught():
    """Each number of section 0's figures and of its tables' rows, changed in its last digit, fails."""
    section = tokens_section((DOCS / "walkthrough.md").read_text(encoding="utf-8"))
    page = str(DOCS / "walkthrough.md")
    assert not tokens_section_problems(page, section)
    lines = section.splitlines()
    targets = [i for i, line in enumerate(lines)
               if any(re.search(p, line) for p in TOKEN_FIGURES["walkthrough.md"].values())
               or re.match(r"^\s+\d+\s+\d+\s+\S", line) or re.match(r"^\d+ tokens, ", line)]
    mutants = 0
    for i in targets:
        for m in re.finditer(r"(?<![\w.])\d(?:[\d,.]*\d)?", lines[i]):
            last = m.end() - 1
            mutated = lines[:i] + [lines[i][:last] + str((int(lines[i][last]) + 1) % 10) + lines[i][last + 1 :]]
            text = "\n".join(mutated + lines[i + 1 :])
            assert tokens_section_problems(page, text), f"changing {m.group()!r} in {lines[i]!r} went unnoticed"
            mutants += 1
    assert mutants > 40


# ---------------------------------------------------------------------------------------------- python snippets
SHAPE_COMMENT = re.compile(r"^(\w+) = .*#.*\(([\d, ]+)\)\s*$")  # `logits = model(ids)  # (B, T, V) = (2, 8, 256)`
SERVED_URL = "http://127.0.0.1:8000"


@contextlib.contextmanager
def default_server():
    """A served tiny random model named "default" (what the README's client snippet asks for); yields its URL."""
    import string

    import torch
    from serve_helpers import BackgroundServer

    from tinyformer.config import ModelConfig
    from tinyformer.data.tokenizer import build_tokenizer
    from tinyformer.models.decoder import DecoderLM
    from tinyformer.serve.app import create_app

    tok = build_tokenizer("char", string.printable)
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=1, n_head=2, max_seq_len=128)).eval()
    with BackgroundServer(create_app(model, tok, model_name="default", max_batch=2)) as srv:
        yield srv.url


def python_block_problems(path: Path, text: str | None = None) -> list[str]:
    """Run every ```python block of the page (or of ``text``) in order; what fails, and each shape comment
    that does not hold."""
    md = parse_markdown(path, text)
    problems: list[str] = []
    namespace: dict = {"__name__": "__doc_snippet__"}
    for block in md.blocks:
        if block.lang != "python" or block.marker == "no-run":
            continue
        code = "\n".join(block.lines)
        where = f"{_rel(path)}:{block.start}"
        with contextlib.ExitStack() as stack:
            if SERVED_URL in code:
                code = code.replace(SERVED_URL, stack.enter_context(default_server()))
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    exec(compile(code, where, "exec"), namespace)
            except Exception as exc:
                problems.append(f"{where}: the snippet fails: {exc!r}")
                continue
        for line in block.lines:
            m = SHAPE_COMMENT.match(line.strip())
            if m:
                want = tuple(int(v) for v in m.group(2).split(","))
                got = tuple(getattr(namespace.get(m.group(1)), "shape", ()))
                if got != want:
                    problems.append(f"{where}: {m.group(1)} has shape {got}, the comment says {want}")
    return problems


@pytest.mark.parametrize("path", PYTHON_PAGES, ids=lambda p: _rel(p))
def test_every_python_snippet_runs_and_its_shape_comments_hold(path):
    assert any(b.lang == "python" for b in parse_markdown(path).blocks)
    problems = python_block_problems(path)
    assert not problems, "\n".join(problems)


def test_a_broken_snippet_or_shape_comment_fails_and_a_no_run_marker_needs_a_reason(tmp_path):
    page = DOCS / "walkthrough.md"
    text = page.read_text(encoding="utf-8")
    assert not python_block_problems(page, text)
    broken = {
        "a config the model refuses": text.replace("n_kv_head=2, max_seq_len=32", "n_kv_head=3, max_seq_len=32"),
        "a name that does not exist": text.replace("logits = model(ids)", "logits = modle(ids)"),
        "a wrong shape in a comment": text.replace("(B, T, V) = (2, 8, 256)", "(B, T, V) = (2, 8, 257)"),
    }
    for what, mutated in broken.items():
        assert mutated != text, what
        assert python_block_problems(page, mutated), f"{what} went unnoticed"
    skipped = text.replace("```python", "<!-- no-run: shown, not run -->\n```python", 1)
    assert not python_block_problems(page, skipped.replace("logits = model(ids)", "logits = modle(ids)"))
    unexplained = text.replace("```python", "<!-- no-run: -->\n```python", 1)
    assert python_block_problems(page, unexplained.replace("logits = model(ids)", "logits = modle(ids)"))


def test_experiments_page_reads_the_post_norm_gradient_ratio_as_the_table_gives_it():
    """docs/experiments.md's gradient figures: last / first block per placement, and Post-Norm's blocks 2-24
    flat, block 1 the outlier (the results table of docs/experiments/norm_placement.md)."""
    text = " ".join((DOCS / "experiments.md").read_text(encoding="utf-8").split())
    column = "grad norm at init, blocks 1 / 2 / last"
    pre, post = ([_number(v) for v in norm_placement_results()[(f"{p}-norm, no warm-up", "24", "0.001")][column]
                  .split(" / ")] for p in ("pre", "post"))
    m = re.search(rf"last block relative to the first was {NUM} in the Pre-Norm stack and {NUM} in the Post-Norm "
                  rf"stack\. The Post-Norm ratio comes from block 1 alone: blocks 2 to 24 all get {NUM} \(last "
                  rf"against second: {NUM}, flat across depth\), while block 1 gets {NUM}, {NUM} times as much", text)
    assert m, "the gradient sentence of docs/experiments.md changed"
    want = [pre[2] / pre[0], post[2] / post[0], post[1], post[2] / post[1], post[0], post[0] / post[1]]
    wrong = [(s, w) for s, w in zip(m.groups(), want) if not shown_equals(s, w)]
    assert not wrong, wrong


# ---------------------------------------------------------------------------------------------- prose figures
PROSE_INTEGER = re.compile(r"(?<![\w.,])\d{1,3}(?:,\d{3})+(?![\d,])")  # 135,266,304
PROSE_SIZE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?) ?(KiB|MiB|GiB|GB|%)")  # 320 KiB, 61.0 GiB, 8 %
PROSE_RATIO = re.compile(r"\b1 : (\d+\.\d+)")  # attention : FFN = 1 : 2.02
#: figures the prose quotes as the mistake it corrects (correction 4: "61.5 GB in FP16")
QUOTED_SLIPS = {"61.5 GB"}
SIZE_UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "GB": 1e9}
#: how the prose names the presets whose attention : FFN ratio it gives (the last one named on a bullet counts)
RATIO_PRESETS = {"LLaMA-7B": "llama-7b", "Llama-2-70B": "llama2-70b", "tiny": "tiny"}


@cache
def computed_figures() -> tuple[frozenset, frozenset, dict[str, float]]:
    """(integers, byte sizes and percentages, preset -> attention : FFN ratio) that the code computes for what
    the walkthrough describes: every number `tinyformer count --json` gives for the presets and commands the
    page uses (sizes: its byte counts only), the formulas its prose writes out, and the settings it quotes."""
    from tinyformer.training.objectives.mlm import mask_tokens

    reports = [count_json("--preset", p) for p in ("llama-7b", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b",
                                                   "gpt2-124m", "gpt2-350m", "gpt3-175b", "tiny")]
    reports += [count_json("--preset", "gpt2-124m", "--seq-len", "1024"),
                count_json("--preset", "llama2-70b", "--seq-len", "4096", "--batch", "8")]
    numbers: set = set()
    byte_counts: set = set()

    def collect(value: object, key: str = "") -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                collect(v, k)
        elif isinstance(value, int) and not isinstance(value, bool):
            numbers.add(value)
            if "bytes" in key:
                byte_counts.add(float(value))

    for report in reports:
        collect(report)
    llama, gpt2 = _preset("llama-7b"), _preset("gpt2-124m")
    # the attention term of the training FLOPs, 12 L d T (section "Training FLOPs"), at T = 2048 and 1024
    llama_term, gpt2_term = (12 * cfg.n_layer * cfg.d_model * t for cfg, t in ((llama, 2048), (gpt2, 1024)))
    numbers |= {8 * llama.d_model**2, 12 * llama.n_layer * llama.d_model**2, llama_term}
    numbers.add(sum(len(p.read_text(encoding="utf-8")) for p in TOKEN_EXAMPLES.glob("*.txt")))  # section 0's corpus
    sizes = set(byte_counts)
    long_scores = count_json("--preset", "llama-7b", "--seq-len", "128000", "--dtype", "float32")["attention_memory"]
    sizes.add(long_scores["naive_scores_bytes_per_layer"] / llama.n_head)  # one head's scores at 128K (correction 4)
    kv = count_json("--preset", "llama2-70b", "--seq-len", "4096", "--batch", "8")["kv_cache"]
    sizes.add(float(kv["bytes_per_token_if_mha"] * 8 * 4096))  # the cache without GQA, the prose's 80 GiB
    six_n = {name: 6 * count_json("--preset", name)["total_params"] for name in ("llama-7b", "gpt2-124m")}
    percents = {100 * llama_term / six_n["llama-7b"], 100 * gpt2_term / six_n["gpt2-124m"],
                100 * inspect_default(mask_tokens, "mask_prob"), 100 * 0.9}  # BERT's masking rate; top-p 0.9
    ratios = {p: 1 / count_json("--preset", p)["attention_to_ffn_ratio"] for p in set(RATIO_PRESETS.values())}
    return frozenset(numbers), frozenset(sizes | {("%", p) for p in percents}), ratios


def inspect_default(fn: object, name: str) -> object:
    import inspect

    return inspect.signature(fn).parameters[name].default


def prose_figure_problems(text: str) -> list[str]:
    """The figures in the prose of a walkthrough (outside code blocks and the checked fact lines) that no
    computation of :func:`computed_figures` gives, to the digits shown."""
    numbers, sizes, ratios = computed_figures()
    problems, in_block = [], False
    lines = text.splitlines()
    for lineno, line in enumerate(lines, 1):
        if FENCE.match(line):
            in_block = not in_block
        if in_block or line.startswith("    ") or line.startswith("$ "):
            continue
        for m in PROSE_INTEGER.finditer(line):
            if int(m.group().replace(",", "")) not in numbers:
                problems.append(f"line {lineno}: {m.group()} is no figure the code computes")
        for m in PROSE_SIZE.finditer(line):
            shown, unit = m.groups()
            if m.group() in QUOTED_SLIPS or m.group().replace(" ", "") in QUOTED_SLIPS:
                continue
            if unit == "%":
                ok = any(shown_equals(shown, p) for kind, p in (s for s in sizes if isinstance(s, tuple)))
            else:
                ok = any(shown_equals(shown, b / SIZE_UNITS[unit]) for b in sizes if not isinstance(b, tuple))
            if not ok:
                problems.append(f"line {lineno}: {m.group()} is no size the code computes")
        for m in PROSE_RATIO.finditer(line):
            # the ratio of the preset its bullet names (from the bullet's first line to this one)
            start = next((j for j in range(lineno - 1, max(-1, lineno - 6), -1) if lines[j].startswith("- ")),
                         lineno - 1)
            bullet = " ".join(lines[start:lineno])
            named = [p for word, p in RATIO_PRESETS.items() if word in bullet]
            if not named or not shown_equals(m.group(1), ratios[named[-1]]):
                problems.append(f"line {lineno}: {m.group()} is not the attention : FFN ratio of {named} the code "
                                "computes")
    return problems


@pytest.mark.parametrize("path", WALKTHROUGHS, ids=lambda p: p.name)
def test_every_count_size_and_ratio_in_the_walkthrough_prose_is_one_the_code_computes(path):
    text = path.read_text(encoding="utf-8")
    assert len(PROSE_INTEGER.findall(text)) > 20
    problems = prose_figure_problems(text)
    assert not problems, "\n".join(problems)


def test_a_wrong_digit_in_a_prose_figure_is_caught():
    text = (DOCS / "walkthrough.md").read_text(encoding="utf-8")
    assert not prose_figure_problems(text)
    lines = text.splitlines()
    mutants = 0
    for i, line in enumerate(lines):
        if line.startswith("    ") or not (PROSE_INTEGER.search(line) or PROSE_SIZE.search(line)
                                           or PROSE_RATIO.search(line)):
            continue
        spans = [m.span() for rx in (PROSE_INTEGER, PROSE_RATIO) for m in rx.finditer(line)]
        spans += [m.span(1) for m in PROSE_SIZE.finditer(line) if m.group() not in QUOTED_SLIPS]
        for _, end in spans:
            last = end - 1
            mutated = line[:last] + str((int(line[last]) + 1) % 10) + line[last + 1 :]
            if prose_figure_problems("\n".join([*lines[:i], mutated, *lines[i + 1 :]])) == []:
                in_block = sum(1 for x in lines[:i] if FENCE.match(x)) % 2
                assert in_block, f"changing the last digit of {line[:end]!r} went unnoticed"
                continue
            mutants += 1
    assert mutants > 30
