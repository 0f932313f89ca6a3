"""A config file or an override read as YAML within bounds: :class:`StrictLoader` refuses a key
given twice, nesting, size and integers beyond the limits below before any value is used, and
each refusal is one line naming the line of the file (:func:`read_config_file`,
:func:`parse_override`)."""
from __future__ import annotations

import os

import yaml

from hpc.runtime.config_values import check_text
from hpc.runtime.errors import UserError, shown

MAX_CONFIG_BYTES = 2 ** 20  # a config file: a few KiB; read no further than this
MAX_YAML_DEPTH = 16         # a config nests 5 levels (section, 2 nested sections, key, list)
MAX_YAML_NODES = 2 ** 16    # values in a document with every alias expanded: a config has
                            # ~10^2; a "billion laughs" alias bomb 10^9 in a few hundred bytes
MAX_INT_DIGITS = 64         # an integer literal: every integer key's maximum has < 20 digits


class BoundExceeded(yaml.composer.ComposerError):
    """YAML that :class:`StrictLoader` refuses for its size, not its syntax."""


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses what the safe loader accepts without a word: a key
    given twice in one mapping (the safe loader keeps the last), nesting deeper than
    MAX_YAML_DEPTH (the composer recurses per level: 100k ``[`` would end in RecursionError),
    a document of more than MAX_YAML_NODES values once its aliases are expanded (an alias
    bomb: cheap to load, since aliases share one object, but every walk over it or repr of it
    expands it) or an alias to itself, and an integer of more than MAX_INT_DIGITS digits
    (Python refuses to convert 4,300 with a bare ValueError). Each raises a
    :class:`yaml.MarkedYAMLError` whose ``problem_mark`` is the offending line."""

    _depth = 0

    def compose_document(self):
        node = super().compose_document()
        _expanded_size(node, {})
        return node

    def construct_yaml_int(self, node):
        digits = sum(c.isdigit() for c in node.value)
        if digits > MAX_INT_DIGITS:
            raise BoundExceeded(
                None, None, f"an integer of {digits} digits, more than {MAX_INT_DIGITS}",
                node.start_mark)
        return super().construct_yaml_int(node)

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise BoundExceeded(
                    None, None, f"nested more than {MAX_YAML_DEPTH} levels deep",
                    self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            lines = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line
                try:
                    if key in lines:
                        where = (f"line {line + 1}" if lines[key] == line + 1 else
                                 f"lines {lines[key]} and {line + 1}")
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {shown(key)} is given twice ({where}); YAML "
                            f"would keep only the last", key_node.start_mark)
                    lines[key] = line + 1
                except TypeError:  # an unhashable key: the safe loader names it below
                    continue
        return super().construct_mapping(node, deep)


StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)


def _expanded_size(node, sizes: dict) -> int:
    """Values under ``node`` with every alias expanded (``sizes``: memo by node id, None while
    a node is being counted); BoundExceeded past MAX_YAML_NODES or for an alias to itself. Each
    node is visited once, so a bomb costs its few hundred nodes, not their expansion; the
    error marks the first value past the limit."""
    if id(node) in sizes:
        if sizes[id(node)] is None:
            raise BoundExceeded(None, None, "an alias refers to the value that "
                                              "holds it", node.start_mark)
        return sizes[id(node)]
    sizes[id(node)] = None
    children = (node.value if isinstance(node, yaml.SequenceNode) else
                [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                else [])
    total = 1 + sum(_expanded_size(child, sizes) for child in children)
    if total > MAX_YAML_NODES:
        raise BoundExceeded(
            None, None, f"more than {MAX_YAML_NODES} values once its aliases (*name) are "
            f"expanded; a config holds a few hundred", node.start_mark)
    sizes[id(node)] = total
    return total


def yaml_error_text(err: yaml.YAMLError) -> str:
    """One line for a YAML error: its problem and line where it has them."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}: {problem}"
    return str(err).splitlines()[0]


def parse_override(text: str):
    if "=" not in text:
        raise UserError(f"override '{text:.80}' is not of the form section.key=value")
    key, raw = text.split("=", 1)
    check_text(key.strip(), raw)
    try:
        value = yaml.load(raw, Loader=StrictLoader) if raw != "" else ""
    except BoundExceeded as err:
        raise UserError(f"override '{key.strip():.80}': {yaml_error_text(err)}"
                        ) from None
    except yaml.YAMLError:  # text YAML cannot read is a string value
        value = raw
    return key.strip(), value


def read_config_file(path: str) -> dict:
    """The YAML mapping in the file at ``path``: at most MAX_CONFIG_BYTES, UTF-8, read with
    :class:`StrictLoader`; UserError otherwise."""
    if not os.path.isfile(path):
        raise UserError(f"config file not found: {path}")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise UserError(f"config file {path} is larger than {MAX_CONFIG_BYTES} bytes; a "
                            f"config holds a few sections of keys")
        data = yaml.load(raw.decode("utf-8"), Loader=StrictLoader) or {}
    except yaml.YAMLError as err:
        raise UserError(f"config file {path} is not valid YAML: {yaml_error_text(err)}"
                        ) from None
    except UnicodeDecodeError as err:
        raise UserError(f"config file {path} is not UTF-8 text (byte {err.start}: "
                        f"{err.reason})") from None
    except OSError as err:
        raise UserError(f"cannot read config file {path}: {err.strerror or err}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must map section names to keys")
    return data
