"""The ```yaml blocks of a docs/ page with the marker comment before each (`<!-- NAME: TEXT -->`),
read the same way by every test that runs a page's examples (test_docs_rules.py,
test_docs_configuration.py)."""

import os
import re

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FENCE = re.compile(r"^```(\S*)\s*$")


class DocBlock:
    def __init__(self, line, text, marker, marker_line):
        self.line = line                # the line of the opening fence
        self.text = text                # the block's content
        self.marker = marker            # the marker's TEXT, or None
        self.marker_line = marker_line  # the marker's line, or None


def yaml_blocks(path, marker_name):
    """Every ```yaml block of the page at `path`, with the `marker_name` marker of the line before it
    (blank lines aside). Raises on a marker that is not followed by a yaml block, on a comment that
    names the marker but is not one, on a fence left open, and on a block whose language looks like
    YAML but is not exactly `yaml` (it would be skipped silently)."""
    label = os.path.relpath(path, ROOT)
    marker_re = re.compile(r"^<!--\s*" + re.escape(marker_name) + r":\s*(.*?)\s*-->\s*$")
    blocks = []
    pending = None  # (line, text) of a marker not yet followed by its block
    fence = None    # (line, language, lines) while inside a fenced block
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")

    def dangling():
        return AssertionError(f"{label}:{pending[0]}: {marker_name} marker not followed by a yaml block")

    for number, line in enumerate(lines, start=1):
        m = FENCE.match(line)
        if fence is not None:
            if m and m.group(1) == "":
                start, language, body = fence
                if language == "yaml":
                    marker_line, marker = pending if pending else (None, None)
                    pending = None
                    blocks.append(DocBlock(start, "\n".join(body) + "\n", marker, marker_line))
                fence = None
            else:
                fence[2].append(line)
            continue
        if m:
            language = m.group(1)
            if language != "yaml" and re.match(r"(?i)ya?ml", language):
                raise AssertionError(f"{label}:{number}: fence language {language!r}: use yaml")
            if pending is not None and language != "yaml":
                raise dangling()
            fence = (number, language, [])
            continue
        marker = marker_re.match(line)
        if marker:
            if pending is not None:
                raise dangling()
            pending = (number, marker.group(1))
        elif marker_name in line and line.lstrip().startswith("<!--"):
            raise AssertionError(f"{label}:{number}: malformed {marker_name} marker: {line}")
        elif line.strip() and pending is not None:
            raise dangling()
    if fence is not None:
        raise AssertionError(f"{label}:{fence[0]}: fenced block never closed")
    if pending is not None:
        raise dangling()
    return blocks


def unescape(text):
    """A quoted marker argument's text: backslash escapes resolved."""
    return re.sub(r"\\(.)", r"\1", text)
