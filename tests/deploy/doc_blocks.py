"""The fenced blocks of a page with the marker comment before each, read the same way by every test
that runs a page's examples: the ```yaml blocks of docs/ pages (`<!-- NAME: TEXT -->`;
test_docs_rules.py, test_docs_configuration.py) and README.md's command blocks (`<!-- runnable -->`,
`<!-- needs: WHAT -->`; test_readme.py)."""

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


def _page(path):
    """The page at `path` as its label and a list, in order, of ("fence", line, language, text) for
    every fenced block (line: its opening fence) and ("line", number, text) for every line outside
    them. Raises on a fence left open."""
    label = os.path.relpath(path, ROOT)
    items = []
    fence = None  # (line, language, lines) while inside a fenced block
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for number, line in enumerate(lines, start=1):
        m = FENCE.match(line)
        if fence is not None:
            if m and m.group(1) == "":
                items.append(("fence", fence[0], fence[1], "\n".join(fence[2]) + "\n"))
                fence = None
            else:
                fence[2].append(line)
        elif m:
            fence = (number, m.group(1), [])
        else:
            items.append(("line", number, line))
    if fence is not None:
        raise AssertionError(f"{label}:{fence[0]}: fenced block never closed")
    return label, items


def yaml_blocks(path, marker_name):
    """Every ```yaml block of the page at `path`, with the `marker_name` marker of the line before it
    (blank lines aside). Raises on a marker that is not followed by a yaml block, on a comment that
    names the marker but is not one, on a fence left open, and on a block whose language looks like
    YAML but is not exactly `yaml` (it would be skipped silently)."""
    label, items = _page(path)
    marker_re = re.compile(r"^<!--\s*" + re.escape(marker_name) + r":\s*(.*?)\s*-->\s*$")
    blocks = []
    pending = None  # (line, text) of a marker not yet followed by its block

    def dangling():
        return AssertionError(f"{label}:{pending[0]}: {marker_name} marker not followed by a yaml block")

    for item in items:
        if item[0] == "fence":
            _, start, language, text = item
            if language != "yaml" and re.match(r"(?i)ya?ml", language):
                raise AssertionError(f"{label}:{start}: fence language {language!r}: use yaml")
            if language != "yaml":
                if pending is not None:
                    raise dangling()
                continue
            marker_line, marker = pending if pending else (None, None)
            pending = None
            blocks.append(DocBlock(start, text, marker, marker_line))
            continue
        _, number, line = item
        marker = marker_re.match(line)
        if marker:
            if pending is not None:
                raise dangling()
            pending = (number, marker.group(1))
        elif marker_name in line and line.lstrip().startswith("<!--"):
            raise AssertionError(f"{label}:{number}: malformed {marker_name} marker: {line}")
        elif line.strip() and pending is not None:
            raise dangling()
    if pending is not None:
        raise dangling()
    return blocks


def unescape(text):
    """A quoted marker argument's text: backslash escapes resolved."""
    return re.sub(r"\\(.)", r"\1", text)


# The languages of command blocks: each must carry a marker (command_blocks).
COMMAND_LANGUAGES = ("sh", "bash", "shell", "console", "python")
# What a block marked `<!-- needs: WHAT -->` needs, and so why it is not run.
NEEDS = {
    "build": "installs packages or builds (deploy/demo.sh, tests/run.sh, cmake)",
    "cluster": "a machine or cluster of yours: systemd, Docker or Kubernetes",
    "job": "a training job of yours (its log, its launcher)",
}
COMMAND_MARKER = re.compile(r"^<!--\s*(runnable(?::\s*daemon)?|needs:\s*(\S+))\s*-->\s*$")


class CommandBlock:
    def __init__(self, line, language, text, marker, marker_line):
        self.line = line                # the line of the opening fence
        self.language = language        # sh, bash, shell, console or python
        self.text = text                # the block's content
        self.marker_line = marker_line  # the marker's line
        self.runnable = marker.startswith("runnable")
        self.starts_daemon = marker.replace(" ", "") == "runnable:daemon"
        self.needs = marker.split(":", 1)[1].strip() if marker.startswith("needs") else None

    def script(self):
        """What runs: a console block's `$ ` lines, any other block whole."""
        if self.language != "console":
            return self.text
        return "".join(line[2:] + "\n" for line in self.text.split("\n") if line.startswith("$ "))


def command_blocks(path):
    """Every command block (COMMAND_LANGUAGES) of the page at `path`, in order, each with the marker
    of the line before it (blank lines aside): `<!-- runnable -->`, `<!-- runnable: daemon -->` (sh
    or bash only) or `<!-- needs: WHAT -->` with WHAT a key of NEEDS. Raises on a fence without a
    language (it could hold commands that would be skipped silently), on a command block without a
    marker, on a marker not followed by a command block, on a malformed marker or an unknown WHAT,
    and on a fence left open."""
    label, items = _page(path)
    blocks = []
    pending = None  # (line, marker) not yet followed by its block
    for item in items:
        if item[0] == "fence":
            _, start, language, text = item
            if language == "":
                raise AssertionError(f"{label}:{start}: a fenced block without a language (```text for output)")
            if language not in COMMAND_LANGUAGES:
                if pending is not None:
                    raise AssertionError(f"{label}:{pending[0]}: marker followed by a {language} block, not a "
                                         f"command block")
                continue
            if pending is None:
                raise AssertionError(f"{label}:{start}: a {language} block without a marker (<!-- runnable -->, "
                                     f"<!-- runnable: daemon --> or <!-- needs: {'|'.join(NEEDS)} -->)")
            block = CommandBlock(start, language, text, pending[1], pending[0])
            if block.starts_daemon and language not in ("sh", "bash"):
                raise AssertionError(f"{label}:{pending[0]}: runnable: daemon marks sh or bash blocks only")
            blocks.append(block)
            pending = None
            continue
        _, number, line = item
        marker = COMMAND_MARKER.match(line)
        if marker:
            if pending is not None:
                raise AssertionError(f"{label}:{pending[0]}: marker not followed by a command block")
            if marker.group(2) is not None and marker.group(2) not in NEEDS:
                raise AssertionError(f"{label}:{number}: needs: {marker.group(2)}: not one of {', '.join(NEEDS)}")
            pending = (number, marker.group(1))
        elif line.lstrip().startswith("<!--") and re.search(r"runnable|needs", line):
            raise AssertionError(f"{label}:{number}: malformed marker: {line}")
        elif line.strip() and pending is not None:
            raise AssertionError(f"{label}:{pending[0]}: marker not followed by a command block")
    if pending is not None:
        raise AssertionError(f"{label}:{pending[0]}: marker not followed by a command block")
    return blocks
