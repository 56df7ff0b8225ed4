"""`gradwatch completion bash|zsh` in real shells: the script loads, registers itself for
`gradwatch`, and completes commands at every depth, past global options and their values, and the
options of the command reached. zsh runs the same function through bashcompinit (its compgen
leaves prefix matching to compadd, so there the candidates are checked to include the right ones).

Environment: GRADWATCH_CLI_PATH.
"""

import os
import shutil
import subprocess
import tempfile
import unittest

CLI = os.environ.get("GRADWATCH_CLI_PATH", "gradwatch")

# (words typed, the word being completed last) -> what must be offered
CASES = [
    (["gradwatch", "sil"], {"silence"}),
    (["gradwatch", "silence", "a"], {"add"}),
    (["gradwatch", "--addr", "127.0.0.1:7390", "sh"], {"show"}),
    (["gradwatch", "--timeout", "5s", "series", "--fr"], {"--from"}),
    (["gradwatch", "silence", "add", "--du"], {"--duration"}),
    (["gradwatch", "rules", "re"], {"reload"}),
    (["gradwatch", "completion", "z"], {"zsh"}),
    (["gradwatch", "he"], {"help"}),
]


class CompletionTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="gradwatch-completion-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def script(self, shell):
        r = subprocess.run([CLI, "completion", shell], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        path = os.path.join(self.dir, f"gradwatch.{shell}")
        with open(path, "w") as f:
            f.write(r.stdout)
        return path

    def complete(self, shell, words, prelude):
        """The candidates the completion function offers for `words` in `shell`."""
        array = " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)
        program = (f"{prelude}\nCOMP_WORDS=({array}); COMP_CWORD={len(words) - 1}; COMPREPLY=(); _gradwatch; "
                   'for w in "${COMPREPLY[@]}"; do echo "$w"; done\n')
        r = subprocess.run([shell, "-c", program], capture_output=True, text=True, timeout=60, cwd=self.dir)
        self.assertEqual(r.returncode, 0, r.stderr)
        return set(r.stdout.split())

    def test_bash(self):
        path = self.script("bash")
        r = subprocess.run(["bash", "-c", f"source {path}; complete -p gradwatch"], capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(r.stdout.strip(), "complete -F _gradwatch gradwatch", r.stderr)
        for words, expected in CASES:
            with self.subTest(words=words):
                # bash filters by the typed prefix: exactly the matching candidates.
                got = self.complete("bash", words, f"source {path}")
                self.assertTrue(expected <= got, f"{words}: {got}")
                self.assertTrue(all(c.startswith(words[-1]) for c in got), f"{words}: {got}")
        # After an option that takes a value: files.
        open(os.path.join(self.dir, "run.jsonl"), "w").close()
        self.assertIn("run.jsonl", self.complete("bash", ["gradwatch", "replay", "ru"], f"source {path}"))
        self.assertIn("gradwatch.bash", self.complete("bash", ["gradwatch", "--tls-ca", "grad"], f"source {path}"))
        # A command's own subcommands, not the top level's.
        self.assertEqual(self.complete("bash", ["gradwatch", "silence", ""], f"source {path}"), {"add", "list", "remove"})

    def test_zsh(self):
        path = self.script("zsh")
        prelude = f"autoload -U compinit && compinit -u -D\nsource {path}\nsetopt ksharrays"
        r = subprocess.run(["zsh", "-c", f"{prelude}\nprint -r -- ${{_comps[gradwatch]}}"], capture_output=True,
                           text=True, timeout=60, cwd=self.dir)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("_gradwatch", r.stdout)
        for words, expected in CASES:
            with self.subTest(words=words):
                got = self.complete("zsh", words, prelude)
                self.assertTrue(expected <= got, f"{words}: {got}")
        self.assertEqual(self.complete("zsh", ["gradwatch", "silence", ""], prelude), {"add", "list", "remove"})
        self.assertNotIn("replay", self.complete("zsh", ["gradwatch", "silence", "add", "--d"], prelude))


if __name__ == "__main__":
    unittest.main()
