"""Pull Python definitions out of a model's completion and join a helper's and a main agent's code.

A completion is what a model wrote: possibly markdown with fenced code, chatter before and after,
usage examples, a definition written twice (the second time fixed, or cut off by the token limit).
``extract_code`` keeps only what a program needs from it: ``import`` statements and top-level
function and class definitions. Everything else at the top level (prose, prints, example calls,
asserts, ``if __name__ == "__main__":`` blocks, module constants) is dropped.

Loading the joined program still runs code, and not only the imports: a definition evaluates its
decorators, its parameters' default values and annotations when it is defined, and a class runs its
body. That is deliberate (``@functools.cache`` and ``def f(xs, seen=None)`` are ordinary code) and
safe, because loading is just another call into the program: it happens in the sandbox, in the
program's own process, which holds no test and whose every message the judge checks
(:mod:`teamrl.sandbox._harness`). What the dropping buys is that example calls and prints the model
wrote around its code do not run at every test; it is not a security boundary.

Rules, in order:

1. Markdown: when the text has ``````` fences, only the fenced code counts (Python-tagged or untagged
   blocks; other languages only when there is nothing else); a fence left open (generation cut
   off) runs to the end of the text. Each block is dedented.
2. Blocks: when the code parses as a whole, its top-level statements are used as they are. Otherwise
   it is cut into blocks at the lines that start (in column 0) an ``import``/``from ... import``,
   a ``def``/``async def``/``class`` header or a decorator; a block runs over the following lines
   that are blank, indented, or start with a closing bracket, and ends at the first other line.
3. Imports are kept only if they parse (an "import" line of prose is not code). Definitions are kept
   even when they do not parse, so a broken function still counts as written and the joined
   program's syntax check fails on it.
4. Duplicates: of several definitions of one name, the last one that parses on its own wins; if
   none parses, the last one.

"Parses" means :func:`teamrl.feedback.static.parse_code` accepts it: code too long or too deeply
nested to analyse counts as not parsing, and no block of a code text too long to analyse is parsed.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass

from teamrl.feedback.static import MAX_SOURCE_CHARS, UnanalysableCode, parse_code, source_lines

_FENCE = re.compile(r"^\s*```+\s*([\w+-]*)")
_PYTHON_TAGS = {"", "python", "py", "python3", "py3"}
_DEFINITION = re.compile(r"^(?:async[ \t]+def|def)[ \t]+([A-Za-z_]\w*)[ \t]*\(|^class[ \t]+([A-Za-z_]\w*)[ \t]*[(:]")
_IMPORT = re.compile(r"^(?:import[ \t]+[A-Za-z_]|from[ \t]+[.\w]+[ \t]+import\b)")


@dataclass(frozen=True)
class Definition:
    """A top-level function or class definition (decorators included).

    Attributes:
        name: the defined name.
        kind: ``function`` or ``class``.
        source: its source text.
        parses: whether the source parses on its own.
    """

    name: str
    kind: str
    source: str
    parses: bool

    def node(self) -> ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | None:
        """The definition's AST node, or None when it does not parse."""
        tree = safe_parse(self.source) if self.parses else None
        return tree.body[0] if tree is not None and tree.body else None  # type: ignore[return-value]


@dataclass(frozen=True)
class ExtractedCode:
    """The code found in one completion: imports and definitions (duplicates resolved)."""

    imports: tuple[str, ...]
    definitions: tuple[Definition, ...]

    def definition(self, name: str) -> Definition | None:
        """The definition of ``name``, or None."""
        return next((item for item in self.definitions if item.name == name), None)

    @property
    def source(self) -> str:
        """The kept code as one module: imports first, then the definitions."""
        return render(self.imports, self.definitions)


def safe_parse(source: str) -> ast.Module | None:
    """The tree of ``source``, or None where :func:`teamrl.feedback.static.parse_code` raises: it does
    not parse, or it is too long or too deeply nested to analyse."""
    try:
        return parse_code(source)
    except (SyntaxError, UnanalysableCode):
        return None


def render(imports: tuple[str, ...], definitions: tuple[Definition, ...]) -> str:
    """Imports, then definitions, as one module's source."""
    parts = ["\n".join(imports)] if imports else []
    parts += [definition.source for definition in definitions]
    return "\n\n\n".join(parts) + "\n" if parts else ""


def strip_markdown(text: str) -> str:
    """The fenced code of a markdown completion (dedented, blocks joined), or the dedented text."""
    blocks: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        fence = _FENCE.match(line)
        if fence and current is None:
            current = []
            blocks.append((fence.group(1).lower(), current))
        elif fence:
            current = None
        elif current is not None:
            current.append(line)
    if not blocks:
        return textwrap.dedent(text)
    python = [lines for tag, lines in blocks if tag in _PYTHON_TAGS]
    chosen = python or [lines for _, lines in blocks]
    return "\n\n".join(textwrap.dedent("\n".join(lines)) for lines in chosen)


def _block_end(lines: list[str], start: int) -> int:
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end][0] in " \t)]}"):
        end += 1
    return end


def _lexical_blocks(code: str) -> list[tuple[str | None, str, str]]:
    """(name, kind, source) of each block cut out by line rules; name None for imports."""
    lines = code.splitlines()
    blocks: list[tuple[str | None, str, str]] = []
    index = 0
    while index < len(lines):
        start = index
        while index < len(lines) and lines[index].startswith("@"):
            index += 1
        if index >= len(lines):
            break
        definition = _DEFINITION.match(lines[index])
        if definition:
            end = _block_end(lines, index)
            kind = "function" if definition.group(1) else "class"
            name = definition.group(1) or definition.group(2)
            blocks.append((name, kind, "\n".join(lines[start:end]).rstrip()))
        elif start == index and _IMPORT.match(lines[index]):
            end = _block_end(lines, index)
            blocks.append((None, "import", "\n".join(lines[start:end]).rstrip()))
        else:  # prose or top-level code (dropped); after stray decorators, look at this line afresh
            end = max(index, start + 1)
        index = end
    return blocks


def _ast_blocks(code: str, tree: ast.Module) -> list[tuple[str | None, str, str]]:
    lines = source_lines(code)  # numbered as the tree's line numbers count
    blocks: list[tuple[str | None, str, str]] = []
    for node in tree.body:
        start = min([node.lineno] + [decorator.lineno for decorator in getattr(node, "decorator_list", [])])
        source = "\n".join(lines[start - 1:node.end_lineno])
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            blocks.append((None, "import", source))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            blocks.append((node.name, "function", source))
        elif isinstance(node, ast.ClassDef):
            blocks.append((node.name, "class", source))
    return blocks


def extract_code(completion: str) -> ExtractedCode:
    """The imports and definitions of a completion (see the module docstring for the rules)."""
    if not isinstance(completion, str):
        raise TypeError(f"extract_code expects the completion text (str), got {type(completion).__name__}")
    code = strip_markdown(completion)
    tree = safe_parse(code)
    blocks = _ast_blocks(code, tree) if tree is not None else _lexical_blocks(code)
    # Parsing every block of a text too long to analyse would cost as much as parsing it whole.
    analysable = len(code) <= MAX_SOURCE_CHARS
    imports: list[str] = []
    chosen: dict[str, tuple[int, Definition]] = {}
    for position, (name, kind, source) in enumerate(blocks):
        parses = tree is not None or (analysable and safe_parse(source) is not None)
        if name is None:
            if parses and source not in imports:
                imports.append(source)
            continue
        previous = chosen.get(name)
        if parses or previous is None or not previous[1].parses:
            chosen[name] = (position, Definition(name=name, kind=kind, source=source, parses=parses))
    definitions = tuple(definition for _, definition in sorted(chosen.values(), key=lambda item: item[0]))
    return ExtractedCode(imports=tuple(imports), definitions=definitions)


def join_team_program(aux: ExtractedCode, main: ExtractedCode, aux_name: str = "aux") -> str:
    """One program from the helper's code and the main agent's code.

    Imports of both (deduplicated) come first, then the helper's definitions, then the main agent's.
    ``aux_name`` belongs to the helper: a copy the main agent wrote is dropped (even when the helper
    wrote none, so the helper's part of the team is never credited with the main agent's work).
    Any other name both define ends up as the main agent's, as Python's later definition wins.
    """
    imports = tuple(dict.fromkeys(aux.imports + main.imports))
    definitions = aux.definitions + tuple(item for item in main.definitions if item.name != aux_name)
    return render(imports, definitions)
