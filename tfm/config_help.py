"""`./launch.sh train CONFIG --help`: every section and field of a config with its value and a
one-line doc.

The docs come from where each typed section is defined, so there is no second list to keep up
to date: a field's comment (on its line, or the block just above it), a mention of it in its
class's comments (`` `name` ...``), or its entry in the class's or module's docstring
(`name (default: ...)` or `name, other: ...`).
"""

from __future__ import annotations

import inspect
import re
import sys
from typing import Any

DOC_WIDTH = 100  # characters of a doc before it is cut with "..."


def _sections() -> dict[str, list[Any]]:
    """Where each config section's fields are defined: dataclasses, or (module, dict name)."""
    from tfm.data.config import DataConfig
    from tfm.decode.search import DecodeConfig
    from tfm.nn.config import ModelConfig
    from tfm.training import optim
    from tfm.training.config import EvalConfig, GenerateConfig, TrainConfig

    return {
        "model": [ModelConfig],
        "data": [DataConfig],
        "optimizer": [(optim, "DEFAULTS")],
        "train": [TrainConfig],
        "eval": [EvalConfig],
        "generate": [GenerateConfig, DecodeConfig],
    }


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= DOC_WIDTH else text[: DOC_WIDTH - 3].rstrip() + "..."


def _first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence (not "sec. 3.4" or "e.g.")."""
    match = re.match(r"(.+?\.)(\s+[A-Z`(\"]|$)", text)
    return match.group(1) if match else text


def _is_header(sentence: str) -> bool:
    """A comment that only names a group of fields ("Sizes.", "lengths and batching")."""
    return len(sentence.split()) <= 5


def _field_comments(lines: list[str], pattern: str) -> tuple[dict[str, str], str]:
    """{field: its comment} for the field lines matching `pattern` (group 1: the name): the
    comment on its line, else the comment block just above it (a header sentence dropped);
    and all comments joined (where a field is mentioned by name)."""
    docs: dict[str, str] = {}
    block: list[str] = []
    everything: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            everything.append(block[-1])
            continue
        match = re.match(pattern, line)
        if match:
            inline = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            everything.append(inline)
            above = " ".join(block)
            first = _first_sentence(above)
            if above and _is_header(first):
                above = above[len(first):].strip()
            docs[match.group(1)] = inline or _first_sentence(above).rstrip(".")
        block = []
    return docs, " ".join(everything)


def _mention(name: str, text: str) -> str:
    """The clause of `text` about `name`: "`name` ..." up to ";" or a sentence end."""
    match = re.search(rf"`{name}`([^;]*?)(;|\.\s|\.$|$)", text)
    return f"{name}{match.group(1)}".strip() if match else ""


def _docstring_entry(name: str, text: str) -> str:
    """`name (...)` (with what follows a colon) or `name[, other]: ...` in a docstring's list
    of fields (where a name starts an entry: after "," ";" ":" "." or ")")."""
    text = " ".join(text.split())
    entry_start = r"(?:(?<=[,;:.)] )|^)"
    match = re.search(rf"{entry_start}(?:\w+, )*{name}(?:, \w+)* \(", text)
    if match:
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        entry = text[match.end(): end]
        if text[end + 1: end + 2] == ":":  # "name (default): what it is"
            entry += ": " + re.split(r"\s\w+ \(|;|\.\s", text[end + 2:], maxsplit=1)[0]
        return entry.strip()
    match = re.search(rf"{entry_start}(?:\w+, )*{name}(?:, \w+)*: ([^;]+?)(;|\.\s|\.$|$)", text)
    return match.group(1).strip() if match else ""


def _without_default(doc: str, default: Any) -> str:
    """A docstring entry without its leading default ("0: shuffling" -> "shuffling"): the
    value is listed beside it."""
    for shown in {repr(default), str(default), f'"{default}"'}:
        if doc == shown:
            return ""
        for separator in (": ", ", ", "; "):
            if doc.startswith(shown + separator):
                return doc[len(shown) + len(separator):]
    return doc


def field_docs() -> dict[str, dict[str, str]]:
    """{section: {field: one-line doc}} for the typed config sections."""
    result: dict[str, dict[str, str]] = {}
    for section, sources in _sections().items():
        docs: dict[str, str] = {}
        for source in sources:
            if isinstance(source, tuple):
                module, name = source
                lines, _ = inspect.getsourcelines(module)
                start = next(i for i, line in enumerate(lines) if line.startswith(f"{name}"))
                end = next(i for i in range(start, len(lines)) if lines[i].startswith("}"))
                comments, all_comments = _field_comments(lines[start:end], r'\s+"(\w+)":')
                docstrings = [module.__doc__ or ""]
                defaults = dict(getattr(module, name))
            else:
                lines, _ = inspect.getsourcelines(source)
                comments, all_comments = _field_comments(lines, r"    (\w+): [^=]+=")
                docstrings = [source.__doc__ or "", sys.modules[source.__module__].__doc__ or ""]
                defaults = {f.name: f.default for f in source.__dataclass_fields__.values()}
            for field, default in defaults.items():
                doc = comments.get(field) or _mention(field, all_comments)
                for text in docstrings:
                    doc = doc or _without_default(_docstring_entry(field, text), default)
                if doc and field not in docs:
                    docs[field] = _one_line(doc)
        result[section] = docs
    return result


def describe(config: Any) -> str:
    """Every section and field of `config` (a ConfigDict) with its value and its doc."""
    docs = field_docs()
    lines = []
    for section, content in config.items():
        if not hasattr(content, "items"):
            lines.append(f"{section} = {content!r}")
            continue
        lines.append(f"{section}:")
        for field, value in content.items():
            doc = docs.get(section, {}).get(field, "")
            entry = f"  {field} = {value!r}"
            lines.append(f"{entry:<40} {doc}".rstrip() if doc else entry)
    return "\n".join(lines)
