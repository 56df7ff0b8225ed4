"""docs/rules.md checked against gradwatch itself, so that the rule file reference cannot drift from
the code:

- every ```yaml block of the page is a complete rule file: `gradwatch rules check FILE` accepts it
  (exit 0), and `gradwatchd --check-config` loads it beside the built-in rules (the block of the
  built-in rules themselves with alerts.default_rules: false); a block preceded by the line
  `<!-- rules-check: fails "TEXT" -->` must instead make `rules check` exit 1 with TEXT in its errors;
- there is a valid example of every rule kind. The kinds are read from the code in two ways that
  must agree: the names in RuleKindName's table in alerts/rules.cc (`case RuleKind::kX: return
  "name";`), and the list `gradwatch rules check` prints for a rule without a kind;
- the page's kinds table lists, for each kind, exactly the keys of that kind in alerts/rule_parser.cc's
  KindKeys table (the keys every rule takes, CommonKeys, aside);
- the page's template variable table gives each kind exactly the variables `rules check` accepts
  for it (its "unknown variable ... (known: ...)" error lists them);
- the page reproduces alerts/rules/default.yaml as shipped, byte for byte;
- the exit codes the page documents for `rules check` are the CLI's.

Environment: GRADWATCH_CLI_PATH, GRADWATCHD_PATH.
"""

import os
import re
import shutil
import subprocess
import tempfile
import unittest

import yaml

from doc_blocks import unescape, yaml_blocks

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CLI = os.environ.get("GRADWATCH_CLI_PATH", "gradwatch")
DAEMON = os.environ.get("GRADWATCHD_PATH", "gradwatchd")
DOC = os.path.join(ROOT, "docs", "rules.md")
RULES_CC = os.path.join(ROOT, "alerts", "rules.cc")
RULE_PARSER_CC = os.path.join(ROOT, "alerts", "rule_parser.cc")
DEFAULT_RULES = os.path.join(ROOT, "alerts", "rules", "default.yaml")

FAILS = re.compile(r'^fails\s+"((?:[^"\\]|\\.)*)"$')


class Example:
    def __init__(self, line, text, fails):
        self.line = line    # the line of the opening fence in docs/rules.md
        self.text = text    # the block's content
        self.fails = fails  # the expected error text, or None for a valid file


def read_examples():
    """Every ```yaml block of the page, with its `rules-check: fails "TEXT"` marker when the line
    before it (blank lines aside) is one (doc_blocks.yaml_blocks: markers, fences and languages
    checked)."""
    examples = []
    for block in yaml_blocks(DOC, "rules-check"):
        fails = None
        if block.marker is not None:
            m = FAILS.match(block.marker)
            if not m:
                raise AssertionError(f"docs/rules.md:{block.marker_line}: malformed rules-check marker: {block.marker}")
            fails = unescape(m.group(1))
        examples.append(Example(block.line, block.text, fails))
    return examples


def cpp_function_body(source, signature):
    """The text of the C++ function that starts with `signature`, up to its closing brace at
    column 0."""
    start = source.index(signature)
    end = source.index("\n}\n", start)
    return source[start:end]


def kinds_from_source():
    """{enumerator: kind name} from RuleKindName's switch in alerts/rules.cc, e.g.
    {"kThreshold": "threshold", ...}."""
    with open(RULES_CC, encoding="utf-8") as f:
        source = f.read()
    body = cpp_function_body(source, "std::string_view RuleKindName(RuleKind kind)")
    kinds = dict(re.findall(r'case RuleKind::(k\w+):\s*return "([a-z_]+)";', body))
    if len(kinds) < 2:
        raise AssertionError("could not read the kinds from RuleKindName in alerts/rules.cc")
    return kinds


def keys_from_source():
    """(common keys, {kind name: keys of that kind}) from CommonKeys() and KindKeys() in
    alerts/rule_parser.cc."""
    with open(RULE_PARSER_CC, encoding="utf-8") as f:
        source = f.read()
    enumerators = kinds_from_source()
    common_body = cpp_function_body(source, "const std::set<std::string>& CommonKeys()")
    common = set(re.findall(r'"([a-z_]+)"', common_body))
    kind_body = cpp_function_body(source, "const std::set<std::string>& KindKeys(RuleKind kind)")
    per_kind = {}
    for enumerator, keys in re.findall(r"\{RuleKind::(k\w+),\s*\{([^{}]*)\}\}", kind_body):
        per_kind[enumerators[enumerator]] = set(re.findall(r'"([a-z_]+)"', keys))
    if not common or len(per_kind) != len(enumerators):
        raise AssertionError("could not read CommonKeys and KindKeys from alerts/rule_parser.cc")
    return common, per_kind


def section(text, heading):
    """The lines under `heading` (a whole heading line) up to the next heading of any level."""
    lines = text.split("\n")
    out = []
    for line in lines[lines.index(heading) + 1:]:
        if re.match(r"^#+ ", line):
            break
        out.append(line)
    return out


def table_rows(lines):
    """The cells of every table row whose first cell is `code`."""
    rows = []
    for line in lines:
        if re.match(r"^\|\s*`[^`]+`\s*\|", line):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def backticked(cell):
    return re.findall(r"`([^`]+)`", cell)


def rules_check(*paths, json_output=False):
    args = [CLI] + (["--json"] if json_output else []) + ["rules", "check", *paths]
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


class RulesReference(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="gradwatch-docs-rules-")
        with open(DOC, encoding="utf-8") as f:
            cls.doc = f.read()
        cls.examples = read_examples()
        cls.kinds = sorted(set(kinds_from_source().values()))
        with open(DEFAULT_RULES, encoding="utf-8") as f:
            cls.default_rules = f.read()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def write(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    def valid_examples(self):
        return [e for e in self.examples if e.fails is None]

    def test_every_example_passes_or_fails_as_marked(self):
        self.assertGreater(len(self.valid_examples()), 8)
        self.assertGreater(len([e for e in self.examples if e.fails is not None]), 3)
        for example in self.examples:
            with self.subTest(line=example.line):
                path = self.write(f"rules-md-line-{example.line}.yaml", example.text)
                out = rules_check(path)
                if example.fails is None:
                    self.assertEqual(out.returncode, 0, f"docs/rules.md:{example.line}: {out.stderr}")
                    self.assertRegex(out.stdout, r"^\d+ rule\(s\) OK:")
                else:
                    self.assertEqual(out.returncode, 1, f"docs/rules.md:{example.line}: expected to fail, got "
                                                        f"{out.returncode}: {out.stdout}{out.stderr}")
                    self.assertIn(example.fails, out.stderr, f"docs/rules.md:{example.line}")
                    for line in out.stderr.strip().split("\n"):
                        self.assertTrue(line.startswith(path + ":"), f"an error not naming FILE:LINE: {line}")

    def test_valid_examples_load_in_the_daemon(self):
        for example in self.valid_examples():
            with self.subTest(line=example.line):
                rules = self.write(f"daemon-line-{example.line}.yaml", example.text)
                builtin = example.text == self.default_rules
                config = self.write(f"gradwatchd-line-{example.line}.yaml",
                                    "alerts:\n"
                                    f"  default_rules: {'false' if builtin else 'true'}\n"
                                    f"  rule_files: ['{rules}']\n")
                out = subprocess.run([DAEMON, "--check-config", "--config", config], capture_output=True, text=True,
                                     timeout=60)
                self.assertEqual(out.returncode, 0, f"docs/rules.md:{example.line}: {out.stderr}")

    def test_kinds_in_the_code_agree(self):
        probe = self.write("no-kind.yaml", "groups:\n  - name: g\n    rules:\n"
                                           "      - alert: A\n        labels: {severity: page}\n")
        out = rules_check(probe)
        self.assertEqual(out.returncode, 1, out.stderr)
        listed = re.search(r"missing 'kind' \(([^)]*)\)", out.stderr)
        self.assertIsNotNone(listed, out.stderr)
        from_cli = sorted(re.split(r",\s*|\s+or\s+", listed.group(1).strip()))
        self.assertEqual(from_cli, self.kinds,
                         "the kinds rules check names differ from RuleKindName's in alerts/rules.cc")

    def test_every_kind_has_a_valid_example(self):
        shown = set()
        for example in self.valid_examples():
            document = yaml.safe_load(example.text) or {}
            for group in document.get("groups") or []:
                for rule in group.get("rules") or []:
                    shown.add(rule.get("kind"))
        self.assertEqual(sorted(set(self.kinds) - shown), [], "kinds without a valid example in docs/rules.md")

    def test_kinds_table_lists_every_key_of_each_kind(self):
        common, per_kind = keys_from_source()
        rows = {backticked(row[0])[0]: row for row in table_rows(section(self.doc, "## Kinds"))}
        self.assertEqual(sorted(rows), self.kinds, "the kinds table's rows")
        for kind, row in rows.items():
            with self.subTest(kind=kind):
                documented = set(backticked(row[3])) | set(backticked(row[4]))
                self.assertEqual(sorted(documented - common), sorted(per_kind[kind]),
                                 f"keys of {kind}: the table against KindKeys in alerts/rule_parser.cc")
        every_rule = {backticked(row[0])[0] for row in table_rows(section(self.doc, "## Keys of every rule"))}
        self.assertEqual(sorted(every_rule), sorted(common), "the keys of every rule against CommonKeys")

    def test_template_variables_table_is_what_each_kind_accepts(self):
        rows = table_rows(section(self.doc, "### Template variables"))
        documented = {kind: set() for kind in self.kinds}
        for row in rows:
            variable = backticked(row[0])[0]
            kinds = self.kinds if row[1] == "every kind" else backticked(row[1])
            for kind in kinds:
                self.assertIn(kind, documented, f"variable {variable}: unknown kind {kind}")
                documented[kind].add(variable)
        # The example of each kind, with an annotation using a variable no kind has: the error lists
        # the variables the kind accepts.
        first = {}
        for example in self.valid_examples():
            for group in (yaml.safe_load(example.text) or {}).get("groups") or []:
                for rule in group.get("rules") or []:
                    first.setdefault(rule["kind"], rule)
        for kind in self.kinds:
            with self.subTest(kind=kind):
                rule = dict(first[kind])
                rule["annotations"] = dict(rule.get("annotations") or {}, docs_probe="{{ no_such_variable }}")
                path = self.write(f"probe-{kind}.yaml", yaml.safe_dump({"groups": [{"name": "probe", "rules": [rule]}]},
                                                                       allow_unicode=True, sort_keys=False))
                out = rules_check(path)
                known = re.search(r"unknown variable 'no_such_variable' \(known: (.*), labels\.<name>\)", out.stderr)
                self.assertIsNotNone(known, out.stderr)
                accepted = set(known.group(1).split(", "))
                self.assertEqual(sorted(documented[kind]), sorted(accepted),
                                 f"template variables of {kind}: docs/rules.md against rules check")

    def test_builtin_rules_are_shown_as_shipped(self):
        identical = [e for e in self.valid_examples() if e.text == self.default_rules]
        self.assertEqual(len(identical), 1, "docs/rules.md must show alerts/rules/default.yaml exactly once, "
                                            "byte for byte")
        out = rules_check(DEFAULT_RULES, json_output=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        table = [backticked(row[0])[0] for row in table_rows(section(self.doc, "## The built-in rules"))]
        self.assertEqual(table, yaml.safe_load(out.stdout)["rules"], "the built-in rules table, in file order")

    def test_exit_codes_as_documented(self):
        empty = self.write("empty.yaml", "")
        self.assertEqual(rules_check(empty).returncode, 0)
        comments = self.write("comments.yaml", "# nothing yet\n")
        self.assertEqual(rules_check(comments).returncode, 0)
        invalid = self.write("invalid.yaml", "groups:\n  - name: g\n    rules:\n      - alert: A\n        kind: x\n")
        out = rules_check(invalid)
        self.assertEqual(out.returncode, 1)
        self.assertIn(invalid + ":5: rule 'A': unknown kind 'x'", out.stderr)
        out = rules_check(invalid, json_output=True)
        self.assertEqual(out.returncode, 1)
        self.assertFalse(yaml.safe_load(out.stdout)["ok"])
        missing = os.path.join(self.dir, "does-not-exist.yaml")
        out = rules_check(missing)
        self.assertEqual(out.returncode, 1, out.stderr)
        self.assertIn(missing + ": cannot read rules file: no such file", out.stderr)
        out = rules_check(self.dir)  # a directory
        self.assertEqual(out.returncode, 1, out.stderr)
        self.assertIn(self.dir + ": is a directory, not a rules file", out.stderr)
        self.assertEqual(subprocess.run([CLI, "rules", "check"], capture_output=True, timeout=60).returncode, 2)


if __name__ == "__main__":
    unittest.main()
