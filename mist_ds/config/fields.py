"""The config-field table of docs/config.md, generated from the schema's doc comments (so they never
drift; tests/test_conventions.py compares them).

    python -m mist_ds.config.fields      # prints the markdown table
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import typing

from mist_ds.config import schema

GROUPS = (("model", schema.ModelConfig), ("cluster", schema.ClusterConfig), ("train", schema.TrainConfig),
          ("strategy", schema.StrategyConfig), ("tuner", schema.TunerConfig))
_FIELD_LINE = re.compile(r"^\s+(\w+): [^=]+?(?:= (.+?))?\s+# (.+)$")
_CONTINUED_LINE = re.compile(r"^\s+# (.+)$")


def _doc_lines(cls: type) -> dict[str, tuple[str, str]]:
    """field -> (default as written, doc comment) from the class source. A doc comment too long for one line goes on
    in comment-only lines right below its field, joined with a space."""
    found, last = {}, None
    for line in inspect.getsource(cls).splitlines():
        match, continued = _FIELD_LINE.match(line), _CONTINUED_LINE.match(line)
        if match:
            last = match.group(1)
            found[last] = ((match.group(2) or "required").replace("MISSING", "required"), match.group(3))
        elif continued and last is not None:
            found[last] = (found[last][0], f"{found[last][1]} {continued.group(1).strip()}")
        else:
            last = None
    return found


def field_rows(prefix: str, cls: type, skip: frozenset[str] = frozenset()) -> list[tuple[str, str, str]]:
    """(dotted name, default, doc) for every leaf field but `skip`; nested schemas expand in place."""
    docs, hints, rows = _doc_lines(cls), typing.get_type_hints(cls), []
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        hint = hints[field.name]
        name = f"{prefix}.{field.name}" if prefix else field.name
        if dataclasses.is_dataclass(hint):
            rows += field_rows(name, hint)
            continue
        default, doc = docs[field.name]
        if default.startswith("field(default_factory=lambda: "):
            default = default[len("field(default_factory=lambda: "):-1]
        elif default.startswith("field(default_factory=dict)"):
            default = "{}"
        elif default.startswith("field(default_factory=list)"):
            default = "[]"
        default = {"None": "null", "True": "true", "False": "false"}.get(default, default.strip('"'))
        rows.append((name, default, doc.replace("|", "\\|")))
    return rows


def markdown_table() -> str:
    lines = ["| field | default | meaning |", "|---|---|---|"]
    for group, cls in GROUPS:
        lines += [f"| `{name}` | `{default}` | {doc} |" for name, default, doc in field_rows(group, cls)]
    own = field_rows("", schema.MistDsConfig, skip=frozenset(group for group, _ in GROUPS))
    lines += [f"| `{name}` | `{default}` | {doc} |" for name, default, doc in own]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
