"""YAML read with limits: a few hundred bytes of nested aliases must not cost minutes and gigabytes.

PyYAML's ``safe_load`` runs no code, but an alias (``*a``) shares its anchor's node, so ten
lines of aliases of aliases hold billions of values once anything walks them (validation, a
dump, the run's config.yaml). Here the text is composed into nodes first, depth-limited as it
goes (PyYAML recurses once per level); the values they expand to are counted with each shared
node counted once per use, and only a document within every limit is built into Python values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 1 << 20  # a configuration is a few kilobytes; a megabyte is far past any real one
MAX_VALUES = 100_000  # scalars, lists and mappings after every alias is expanded
MAX_DEPTH = 100  # levels of nesting, through aliases too


class LimitError(ValueError):
    """A YAML text past one of the limits; the message says which and the limit."""


class _Loader(yaml.SafeLoader):
    """The safe loader, refusing nesting past ``MAX_DEPTH`` while it composes."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise LimitError(f"is nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def read_text(path: Path) -> str:
    """The UTF-8 text of file ``path``, of which no more than ``MAX_BYTES`` are read (``LimitError`` past them).

    ``OSError`` and ``UnicodeDecodeError`` as ``Path.read_text`` raises them.
    """
    with path.open("rb") as handle:
        data = handle.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise LimitError(f"is larger than {MAX_BYTES // 1024} KiB")
    return data.decode("utf-8")


def load(text: str) -> Any:
    """The value of a YAML document, like ``yaml.safe_load``; ``LimitError`` past a limit.

    ``yaml.YAMLError`` for text that is not YAML, as ``safe_load`` raises; a scalar that
    cannot be converted (an integer of more digits than Python converts) is a ``LimitError``.
    """
    if len(text) > MAX_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise LimitError(f"is larger than {MAX_BYTES // 1024} KiB")
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _measure(node, 1, {}, set())
        try:
            return loader.construct_document(node)
        except (ValueError, OverflowError) as exc:  # int() past 4300 digits, a 30th of February
            raise LimitError(f"holds a value that cannot be read ({exc})") from None
    finally:
        loader.dispose()


def _measure(node: yaml.Node, depth: int, sizes: dict[int, tuple[int, int]], open_nodes: set[int]) -> tuple[int, int]:
    """``(values, levels)`` of ``node`` with its aliases expanded; ``LimitError`` past a limit.

    ``sizes`` remembers each node already measured, so a node shared by many aliases is walked
    once; the recursion goes no deeper than ``MAX_DEPTH``.
    """
    key = id(node)
    if key in open_nodes:
        raise LimitError("holds an alias inside the node it names (a value that contains itself)")
    if key not in sizes:
        children: list[Any] = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        open_nodes.add(key)
        values, levels = 1, 0
        for child in children:
            child_values, child_levels = _measure(child, depth + 1, sizes, open_nodes)
            values, levels = values + child_values, max(levels, child_levels)
            if values > MAX_VALUES:
                raise LimitError(f"expands to more than {MAX_VALUES:,} values once its aliases (*name) are resolved")
        open_nodes.discard(key)
        sizes[key] = (values, levels + 1)
    values, levels = sizes[key]
    if depth + levels - 1 > MAX_DEPTH:
        raise LimitError(f"is nested more than {MAX_DEPTH} levels deep once its aliases (*name) are resolved")
    return values, levels
