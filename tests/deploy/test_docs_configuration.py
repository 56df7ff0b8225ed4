"""docs/configuration.md's examples checked against gradwatchd itself, so that they cannot drift from
the daemon's configuration parser:

- every ```yaml block of the page is a whole configuration file: `gradwatchd --check-config --config
  FILE` accepts it (exit 0), and the configuration it prints as JSON has every value the block sets
  (secrets shown as "<secret>", numbers compared as numbers, lists entry by entry);
- a block preceded by the line `<!-- check-config: fails "TEXT" -->` must instead make
  `--check-config` exit 2 with TEXT in its error;
- a block preceded by `<!-- check-config: file /etc/gradwatch/PATH -->` is not a configuration but a
  file one names (a tokens file, a rule file): it is written there before the configurations are
  checked, so it is checked through them, and some configuration must name it;
- the page's configurations name files under /etc/gradwatch/ only; the test puts that folder in a
  temporary directory (the blocks' paths rewritten to it), with the page's file blocks and TLS
  certificates made by tests/support/make_test_certs.sh (openssl) at the names the page uses;
- there is a valid example of every receiver type the daemon accepts (the list its error for an
  unknown type gives).

Environment: GRADWATCHD_PATH.
"""

import json
import os
import re
import shutil
import subprocess
import tempfile
import unittest

import yaml

from doc_blocks import unescape, yaml_blocks

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DAEMON = os.environ.get("GRADWATCHD_PATH", "gradwatchd")
DOC = os.path.join(ROOT, "docs", "configuration.md")
MAKE_CERTS = os.path.join(ROOT, "tests", "support", "make_test_certs.sh")

FAILS = re.compile(r'^fails\s+"((?:[^"\\]|\\.)*)"$')
FILE = re.compile(r"^file\s+(/\S+)$")

# The folder of the files the examples name; the test makes it in a temporary directory.
FILES_DIR = "/etc/gradwatch/"
# The certificates the examples name, relative to FILES_DIR: which of make_test_certs.sh's files
# stands for each.
CERTIFICATES = {"tls/server.pem": "server.pem", "tls/server.key": "server.key", "tls/clients-ca.pem": "ca.pem"}
# Keys --check-config shows as "<secret>" when set.
SECRETS = {"routing_key", "bearer_token"}


class Block:
    def __init__(self, line, text, fails=None, file=None):
        self.line = line    # the line of the opening fence in docs/configuration.md
        self.text = text    # the block's content
        self.fails = fails  # the expected error text of a failing configuration, else None
        self.file = file    # the path of a file block (under FILES_DIR), else None

    @property
    def is_config(self):
        return self.file is None


def read_blocks():
    """Every ```yaml block of the page, with the check-config marker of the line before it (blank
    lines aside): `fails "TEXT"` or `file PATH` (doc_blocks.yaml_blocks: markers, fences and
    languages checked)."""
    blocks = []
    for block in yaml_blocks(DOC, "check-config"):
        fails = file = None
        if block.marker is not None:
            failing, named = FAILS.match(block.marker), FILE.match(block.marker)
            if failing:
                fails = unescape(failing.group(1))
            elif named:
                file = named.group(1)
            else:
                raise AssertionError(
                    f"docs/configuration.md:{block.marker_line}: malformed check-config marker: {block.marker}")
        blocks.append(Block(block.line, block.text, fails, file))
    return blocks


def named_files(text):
    """The paths under FILES_DIR a block names."""
    return set(re.findall(re.escape(FILES_DIR) + r"[A-Za-z0-9._/-]+", text))


class ConfigurationExamples(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="gradwatch-docs-config-")
        cls.files_dir = os.path.join(cls.dir, FILES_DIR.strip("/")) + "/"
        cls.blocks = read_blocks()
        certs = os.path.join(cls.dir, "certs")
        subprocess.run(["bash", MAKE_CERTS, certs], check=True, timeout=300)
        for name, made in CERTIFICATES.items():
            path = os.path.join(cls.files_dir, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            shutil.copyfile(os.path.join(certs, made), path)
        for block in cls.blocks:
            if block.file is not None:
                if not block.file.startswith(FILES_DIR) or "/../" in block.file:
                    raise AssertionError(f"docs/configuration.md:{block.line}: a file block outside {FILES_DIR}")
                path = cls.local(block.file)
                if os.path.exists(path):
                    raise AssertionError(f"docs/configuration.md:{block.line}: {block.file} is given twice")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(cls.rewrite(block.text))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    @classmethod
    def local(cls, path):
        """Where the test keeps a path under FILES_DIR."""
        return cls.files_dir + path[len(FILES_DIR):]

    @classmethod
    def rewrite(cls, text):
        return text.replace(FILES_DIR, cls.files_dir)

    def configs(self):
        return [b for b in self.blocks if b.is_config and b.fails is None]

    def check_config(self, block):
        path = os.path.join(self.dir, f"configuration-md-line-{block.line}.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.rewrite(block.text))
        return subprocess.run([DAEMON, "--check-config", "--config", path], capture_output=True, text=True,
                              timeout=60)

    def assert_shown(self, expected, actual, key, where):
        """Every value of `expected` (the example, as YAML reads it) is in `actual` (the JSON
        --check-config prints) at the same place."""
        if isinstance(expected, dict):
            self.assertIsInstance(actual, dict, f"{where}: {key}")
            for k, v in expected.items():
                full = f"{key}.{k}" if key else k
                if v is None and not key:
                    continue  # an empty section: the defaults
                self.assertIn(k, actual, f"{where}: {full} is not in the configuration --check-config prints")
                self.assert_shown(v, actual[k], full, where)
        elif isinstance(expected, list):
            self.assertIsInstance(actual, list, f"{where}: {key}")
            self.assertEqual(len(expected), len(actual), f"{where}: {key}: {actual}")
            for i, (e, a) in enumerate(zip(expected, actual)):
                self.assert_shown(e, a, f"{key}[{i}]", where)
        elif key.rsplit(".", 1)[-1] in SECRETS:
            self.assertEqual(actual, "<secret>" if expected not in (None, "") else "", f"{where}: {key}")
        elif isinstance(expected, bool):
            self.assertIs(actual, expected, f"{where}: {key}")
        elif isinstance(expected, (int, float)):
            self.assertIsInstance(actual, (int, float), f"{where}: {key}: {actual!r}")
            self.assertNotIsInstance(actual, bool, f"{where}: {key}: {actual!r}")
            self.assertEqual(float(expected), float(actual), f"{where}: {key}")
        elif isinstance(expected, str):
            self.assertEqual(expected, actual, f"{where}: {key}")
        else:
            self.fail(f"{where}: {key}: a value of type {type(expected).__name__} ({expected!r}) in an example")

    def test_the_page_has_examples_of_each_sort(self):
        self.assertGreaterEqual(len(self.configs()), 5)
        self.assertGreaterEqual(len([b for b in self.blocks if b.fails is not None]), 3)
        self.assertGreaterEqual(len([b for b in self.blocks if b.file is not None]), 2)

    def test_every_example_passes_and_shows_the_values_it_sets(self):
        for block in self.configs():
            with self.subTest(line=block.line):
                out = self.check_config(block)
                self.assertEqual(out.returncode, 0, f"docs/configuration.md:{block.line}: {out.stderr}")
                self.assertTrue(out.stdout.endswith("\nconfiguration OK\n"), out.stdout[-200:])
                shown = json.loads(out.stdout[:out.stdout.rindex("configuration OK")])
                expected = yaml.safe_load(self.rewrite(block.text))
                self.assertIsInstance(expected, dict, f"docs/configuration.md:{block.line}: not a mapping")
                self.assert_shown(expected, shown, "", f"docs/configuration.md:{block.line}")

    def test_every_mistake_fails_with_the_error_shown(self):
        for block in self.blocks:
            if block.fails is None:
                continue
            with self.subTest(line=block.line):
                out = self.check_config(block)
                self.assertEqual(out.returncode, 2, f"docs/configuration.md:{block.line}: expected to fail, got "
                                                    f"{out.returncode}: {out.stdout}{out.stderr}")
                self.assertEqual(out.stdout, "", f"docs/configuration.md:{block.line}")
                self.assertTrue(out.stderr.startswith("gradwatchd: "), out.stderr)
                self.assertIn(block.fails, out.stderr, f"docs/configuration.md:{block.line}")

    def test_every_file_the_examples_name_is_given_and_named(self):
        given = {b.file for b in self.blocks if b.file is not None} | {FILES_DIR + c for c in CERTIFICATES}
        named = set()
        for block in self.blocks:
            if block.is_config:
                with self.subTest(line=block.line):
                    files = named_files(block.text)
                    self.assertEqual(sorted(files - given), [],
                                     f"docs/configuration.md:{block.line}: files the test cannot make (add a "
                                     f"`check-config: file` block, or a certificate to CERTIFICATES)")
                    named |= files
        for block in self.blocks:
            if block.file is not None:
                self.assertIn(block.file, named,
                              f"docs/configuration.md:{block.line}: {block.file} is named by no configuration, "
                              f"so nothing checks it")

    def test_every_receiver_type_has_an_example(self):
        probe = os.path.join(self.dir, "receiver-type-probe.yaml")
        with open(probe, "w", encoding="utf-8") as f:
            f.write("alerts:\n  receivers: [{type: no-such-type, url: 'http://127.0.0.1:9/'}]\n")
        out = subprocess.run([DAEMON, "--check-config", "--config", probe], capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 2, out.stderr)
        listed = re.search(r"type must be ([a-z_, ]+)", out.stderr)
        self.assertIsNotNone(listed, out.stderr)
        types = set(re.split(r",\s*|\s+or\s+", listed.group(1).strip()))
        self.assertGreaterEqual(len(types), 4, types)
        shown = set()
        for block in self.configs():
            document = yaml.safe_load(block.text) or {}
            for receiver in (document.get("alerts") or {}).get("receivers") or []:
                shown.add(receiver.get("type"))
        self.assertEqual(sorted(types - shown), [], "receiver types without a valid example in docs/configuration.md")


if __name__ == "__main__":
    unittest.main()
