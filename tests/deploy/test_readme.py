"""README.md checked as a newcomer meets it, and the links of every page:

- README.md has at most 400 lines (the reference lives in docs/), and its first command block is
  the set-up: `deploy/demo.sh` and `tests/run.sh`;
- every relative link of README.md and docs/*.md leads to a file or folder of the repository, and
  one with an anchor (`page.md#heading`, `#heading`) to a heading of that page, by GitHub's rule
  (lower case; everything but letters, digits, spaces, `-` and `_` dropped; spaces as `-`; `-1`,
  `-2`... for repeats);
- every fenced block of README.md names its language, and every sh, bash, shell, console or python
  block carries one of these markers on the line before it (blank lines aside), so that none is
  skipped silently (doc_blocks.command_blocks):

    <!-- runnable -->          run by this test;
    <!-- runnable: daemon -->  an sh or bash block that starts gradwatchd in the background (its
                               last line ends with `&`): run, then waited for until the daemon
                               serves on 127.0.0.1:7390 and :9390; after the last block it is
                               stopped with SIGTERM and must exit 0;
    <!-- needs: build -->      not run: it installs packages or builds;
    <!-- needs: cluster -->    not run: systemd, Docker or Kubernetes;
    <!-- needs: job -->        not run: a training job of the reader's;

  a block that calls systemctl, docker or kubectl must be marked `needs: cluster`, and a runnable
  block may not use sudo;
- the runnable blocks succeed, one after the other in the README's order, as a reader at the
  checkout's root would run them after the set-up: sh, bash and shell blocks (and a console
  block's `$ ` lines) with `bash -e -o pipefail`, python blocks with /usr/bin/python3 and
  PYTHONPATH=build/python (as the README says to run them). Their working directory is a temporary
  one that mirrors the checkout (its top-level entries linked; build/ holding links to the
  binaries under test and to the Python package built beside them), PATH starts with those
  binaries' folders, and no GRADWATCH_* variable is set, so the daemon and the CLI use their
  defaults: 127.0.0.1:7390 and :9390 must be free. A block may leave no process behind unless it
  is the daemon's. Every wait has a deadline scaled by GRADWATCH_TEST_TIME_SCALE and polls:
  nothing sleeps a fixed time.

Environment: GRADWATCHD_PATH, GRADWATCH_CLI_PATH, GRADWATCH_TEST_TIME_SCALE.
"""

import ctypes
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import unittest

from doc_blocks import ROOT, command_blocks

README = os.path.join(ROOT, "README.md")
SCALE = max(1.0, float(os.environ.get("GRADWATCH_TEST_TIME_SCALE", "1")))
DAEMON = os.environ.get("GRADWATCHD_PATH", "gradwatchd")
CLI = os.environ.get("GRADWATCH_CLI_PATH", "gradwatch")

MAX_LINES = 400
SETUP_COMMANDS = ["deploy/demo.sh", "tests/run.sh"]
DEFAULT_PORTS = (7390, 9390)  # gradwatchd's gRPC and HTTP listeners when not told otherwise
CLUSTER_TOOLS = re.compile(r"\b(systemctl|docker|kubectl)\b")
BLOCK_SECONDS = 300   # one block, start to end
READY_SECONDS = 60    # the daemon, from its block's end to serving
STOP_SECONDS = 60     # the daemon, from SIGTERM to its exit

PR_SET_CHILD_SUBREAPER = 36
FENCE = re.compile(r"^```")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def pages():
    return [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def prose_lines(path):
    """(line number, text) of the lines outside fenced blocks, inline code removed."""
    inside = False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f.read().split("\n"), start=1):
            if FENCE.match(line):
                inside = not inside
                continue
            if not inside:
                yield number, re.sub(r"(`+)(?:(?!\1).)*?\1", "", line)


def slug(heading):
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").lower())
    return text.replace(" ", "-")


def anchors(path):
    found, seen = set(), {}
    inside = False
    with open(path, encoding="utf-8") as f:
        for line in f.read().split("\n"):
            if FENCE.match(line):
                inside = not inside
                continue
            m = None if inside else HEADING.match(line)
            if m:
                base = slug(m.group(2))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
    return found


def resolve(program):
    path = shutil.which(program) if os.sep not in program else program
    if path is None or not os.access(path, os.X_OK):
        raise AssertionError(f"{program}: not found (set GRADWATCHD_PATH and GRADWATCH_CLI_PATH to the built binaries)")
    return os.path.abspath(path)


class ReadmeShape(unittest.TestCase):
    def test_the_readme_is_at_most_400_lines(self):
        with open(README, encoding="utf-8") as f:
            lines = f.read().rstrip("\n").split("\n")
        self.assertLessEqual(len(lines), MAX_LINES, "README.md is for a newcomer: move reference to docs/")

    def test_the_readme_opens_with_the_two_setup_commands(self):
        first = command_blocks(README)[0]
        commands = [line.split()[0] for line in first.script().split("\n") if line.strip()]
        self.assertEqual(commands, SETUP_COMMANDS, f"README.md:{first.line}")
        self.assertEqual(first.needs, "build", f"README.md:{first.line}")

    def test_every_command_block_is_marked_as_its_commands_need(self):
        blocks = command_blocks(README)  # raises on a block without a marker
        self.assertTrue(any(b.runnable for b in blocks), "no runnable block")
        self.assertEqual(sum(b.starts_daemon for b in blocks), 1, "one block starts the daemon")
        for block in blocks:
            with self.subTest(line=block.line):
                uses_cluster = CLUSTER_TOOLS.search(block.script()) is not None
                self.assertEqual(uses_cluster, block.needs == "cluster",
                                 f"README.md:{block.line}: systemctl, docker and kubectl blocks, and only they, "
                                 "are marked needs: cluster")
                if block.runnable:
                    self.assertNotRegex(block.script(), r"\bsudo\b", f"README.md:{block.line}")
                if block.starts_daemon:
                    last = [line for line in block.script().split("\n") if line.strip()][-1]
                    self.assertTrue(last.rstrip().endswith("&"),
                                    f"README.md:{block.line}: a daemon block starts gradwatchd in the background")

    def test_every_relative_link_leads_to_a_file_and_heading(self):
        checked = 0
        for page in pages():
            label = os.path.relpath(page, ROOT)
            for number, line in prose_lines(page):
                for _, target in LINK.findall(line):
                    if SCHEME.match(target):
                        continue
                    path, _, anchor = target.partition("#")
                    resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
                    with self.subTest(page=label, line=number, link=target):
                        self.assertTrue(os.path.exists(resolved), f"{label}:{number}: {target}: no such file")
                        if anchor:
                            self.assertTrue(resolved.endswith(".md"), f"{label}:{number}: {target}: not a page")
                            self.assertIn(anchor, anchors(resolved), f"{label}:{number}: {target}: no such heading")
                    checked += 1
        self.assertGreater(checked, 50)


def port_free(port):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def accepts(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def tail(path, lines=60):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


class QuickStart(unittest.TestCase):
    """The README's runnable blocks, run in order by one test: each builds on the ones before."""

    @classmethod
    def setUpClass(cls):
        cls.blocks = command_blocks(README)
        cls.root = tempfile.mkdtemp(prefix="gradwatch-readme-")
        cls.checkout = os.path.join(cls.root, "checkout")
        cls.logs = os.path.join(cls.root, "logs")
        os.makedirs(cls.logs)
        cls.daemon_group = None
        cls.libc = ctypes.CDLL(None, use_errno=True)
        # The daemon's block exits and leaves it running: as a subreaper this process becomes its
        # parent, so that its exit status can be read.
        cls.libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        try:
            cls.make_checkout()
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def make_checkout(cls):
        os.makedirs(cls.checkout)
        for name in os.listdir(ROOT):
            if name == ".git" or name.startswith("build"):
                continue
            os.symlink(os.path.join(ROOT, name), os.path.join(cls.checkout, name))
        daemon, cli = resolve(DAEMON), resolve(CLI)
        python = os.path.join(os.path.dirname(os.path.dirname(cli)), "python")
        if not os.path.isdir(os.path.join(python, "gradwatch")):
            raise AssertionError(f"{python}: the build's Python package is missing")
        build = os.path.join(cls.checkout, "build")
        for folder, name, target in (("server", "gradwatchd", daemon), ("client", "gradwatch", cli)):
            os.makedirs(os.path.join(build, folder))
            os.symlink(target, os.path.join(build, folder, name))
        os.symlink(python, os.path.join(build, "python"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRADWATCH")}
        env["PATH"] = os.pathsep.join([os.path.join(build, "server"), os.path.join(build, "client"), env.get("PATH", "")])
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        cls.env = env

    @classmethod
    def tearDownClass(cls):
        try:
            if cls.daemon_group is not None:  # a block failed before the end: stop it, quietly
                try:
                    cls.stop_daemon()
                except AssertionError:
                    pass
        finally:
            cls.libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
            shutil.rmtree(cls.root, ignore_errors=True)

    @classmethod
    def reap(cls, group):
        """The exit status of the group's process that ended, if one did; None otherwise (also when
        no process of the group is this process's child)."""
        try:
            pid, status = os.waitpid(-group, os.WNOHANG)
        except ChildProcessError:
            return None
        return status if pid != 0 else None

    @classmethod
    def group_alive(cls, group):
        try:
            os.killpg(group, 0)
            return True
        except ProcessLookupError:
            return False

    @classmethod
    def stop_daemon(cls):
        group, cls.daemon_group = cls.daemon_group, None
        log = os.path.join(cls.checkout, "gradwatchd.log")
        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            raise AssertionError("gradwatchd was gone before the end:\n" + tail(log))
        deadline = time.monotonic() + STOP_SECONDS * SCALE
        status = None
        while True:
            reaped = cls.reap(group)
            status = reaped if reaped is not None else status
            if not cls.group_alive(group):
                break
            if time.monotonic() > deadline:
                os.killpg(group, signal.SIGKILL)
                cls.reap(group)
                raise AssertionError(f"gradwatchd did not stop within {STOP_SECONDS * SCALE:.0f} s of SIGTERM:\n"
                                     + tail(log))
            time.sleep(0.05)
        if status is not None and not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            raise AssertionError(f"gradwatchd ended with {os.waitstatus_to_exitcode(status)} after SIGTERM (expected 0):\n"
                                 + tail(log))

    def run_block(self, index, block):
        output = os.path.join(self.logs, f"block-{index}.out")
        if block.language == "python":
            script = os.path.join(self.logs, f"block-{index}.py")
            with open(script, "w") as f:
                f.write(block.script())
            argv = ["/usr/bin/python3", script]
            env = dict(self.env, PYTHONPATH=os.path.join(self.checkout, "build", "python"))
        else:
            argv = ["bash", "-e", "-o", "pipefail", "-c", block.script()]
            env = self.env
        where = f"README.md:{block.line}"
        with open(output, "w") as out:
            proc = subprocess.Popen(argv, cwd=self.checkout, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        group = proc.pid
        try:
            code = proc.wait(timeout=BLOCK_SECONDS * SCALE)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            proc.wait()
            self.fail(f"{where}: still running after {BLOCK_SECONDS * SCALE:.0f} s:\n{tail(output)}")
        self.assertEqual(code, 0, f"{where}: exit {code}:\n{tail(output)}")
        if block.starts_daemon:
            type(self).daemon_group = group
            self.wait_until_serving(where, group, output)
        else:
            while self.reap(group) is not None:
                pass
            if self.group_alive(group):
                os.killpg(group, signal.SIGKILL)
                self.fail(f"{where}: left a process running (only a daemon block may)")

    def wait_until_serving(self, where, group, output):
        deadline = time.monotonic() + READY_SECONDS * SCALE
        while not all(accepts(port) for port in DEFAULT_PORTS):
            status = self.reap(group)
            if status is not None or not self.group_alive(group):
                code = "?" if status is None else os.waitstatus_to_exitcode(status)
                self.fail(f"{where}: gradwatchd exited ({code}):\n{tail(output)}"
                          f"{tail(os.path.join(self.checkout, 'gradwatchd.log'))}")
            if time.monotonic() > deadline:
                self.fail(f"{where}: gradwatchd not serving on {DEFAULT_PORTS} within {READY_SECONDS * SCALE:.0f} s:\n"
                          f"{tail(os.path.join(self.checkout, 'gradwatchd.log'))}")
            time.sleep(0.1)

    def test_the_runnable_blocks_succeed_in_order(self):
        taken = [port for port in DEFAULT_PORTS if not port_free(port)]
        self.assertEqual(taken, [], "the README's quick start uses gradwatchd's default ports: stop what listens there")
        runnable = [b for b in self.blocks if b.runnable]
        self.assertTrue(runnable[0].starts_daemon, "the first runnable block starts the daemon the others use")
        for index, block in enumerate(runnable):
            self.run_block(index, block)
        type(self).stop_daemon()


if __name__ == "__main__":
    unittest.main()
