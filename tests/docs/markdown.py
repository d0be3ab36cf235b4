"""What the documentation says, read the way a reader copies it: fenced blocks, inline code, the command
lines in both, and the names of environment variables. Standard library only."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^```(\S*)\s*$")
_INLINE = re.compile(r"`([^`]+)`")
ENV_NAME = re.compile(r"\bTRAINYARD_[A-Z0-9_]*")
_SHELL_OPERATORS = {"|", "||", "&&", ";", "&"}


def doc_files() -> list[Path]:
    """The documents the docs tests hold to the code."""
    return [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted(ROOT.glob("services/*/README.md"))]


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Doc:
    path: Path
    blocks: tuple[Block, ...]
    prose: str  # everything outside fenced blocks

    @property
    def inline_code(self) -> list[str]:
        """Inline code spans, whitespace (line breaks included) collapsed."""
        return [" ".join(m.group(1).split()) for m in _INLINE.finditer(self.prose)]


def read_doc(path: Path) -> Doc:
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    prose: list[str] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            prose.append(lines[i])
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        assert end < len(lines), f"{path}:{i + 1}: a fenced block that never ends"
        blocks.append(Block(path, i + 1, m.group(1), "\n".join(lines[i + 1:end])))
        prose.append("")
        i = end + 1
    return Doc(path, tuple(blocks), "\n".join(prose))


def _substitutions(line: str) -> tuple[str, list[str]]:
    """`line` with every $(...) replaced by a placeholder word, and the commands that were inside."""
    inner: list[str] = []
    out: list[str] = []
    i = 0
    while i < len(line):
        if line.startswith("$(", i):
            depth, j = 1, i + 2
            while j < len(line) and depth:
                depth += {"(": 1, ")": -1}.get(line[j], 0)
                j += 1
            body = line[i + 2:j - 1]
            text, nested = _substitutions(body)
            inner += [text, *nested]
            out.append("placeholder.example")
            i = j
        else:
            out.append(line[i])
            i += 1
    return "".join(out), inner


def commands(text: str, *, comments: bool) -> list[list[str]]:
    """The simple commands in shell text (one command line per line; `\\` continues a line), as argv lists
    with leading VAR=value assignments dropped and every $(...) a command of its own."""
    joined = re.sub(r"\\\n", " ", text)
    out: list[list[str]] = []
    for raw in joined.splitlines():
        line, inner = _substitutions(raw)
        for piece in (line, *inner):
            try:
                tokens = shlex.split(piece, comments=comments)
            except ValueError:
                tokens = piece.split()
            current: list[str] = []
            for tok in [*tokens, ";"]:
                if tok in _SHELL_OPERATORS:
                    while current and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", current[0]):
                        current.pop(0)
                    if current:
                        out.append(current)
                    current = []
                else:
                    current.append(tok)
    return out


def flags_of(argv: list[str]) -> list[str]:
    """The long options in argv, up to a `--` that ends them (what follows is the job's own command)."""
    out = []
    for tok in argv[1:]:
        if tok == "--":
            break
        if tok.startswith("--"):
            out.append(tok.split("=", 1)[0])
    return out
