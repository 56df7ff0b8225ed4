"""The installable package (client/python/pyproject.toml) as users get it: its sdist and wheel built
from the source tree, and a wheel built from that sdist with no protoc on PATH; the wheel installed
with pip into clean venvs (no system site packages, PYTHONPATH unset), its dependencies from PyPI,
at the newest grpcio and protobuf and at the oldest the package declares, each running a real
trainer loop against the real gradwatchd; and gradwatch[torch] in a venv that sees Debian's
python3-torch (PyPI's Linux torch pulls several GB of CUDA libraries), running gradwatch.torch.Watch.

Needs PyPI, through pip's own configuration (PIP_* variables, pip.conf): without it every test here
fails, saying so; none is skipped. The whole takes about a minute, most of it pip's (some 20 MB
of downloads when pip's cache does not have them).
"""

from __future__ import annotations

import email
import email.message
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import textwrap
import unittest
import zipfile
from pathlib import Path
from typing import Dict, List, Optional

from gradwatch.v1 import gradwatch_pb2 as pb
from support import Daemon

REPOSITORY = Path(__file__).resolve().parents[2]
PROJECT = REPOSITORY / "client" / "python"
# Debian's interpreter: the one the torch venv's system site packages are Debian's python3-torch for.
PYTHON = "/usr/bin/python3"
# Any one step (a venv, a build, an install, a run); pip's own network timeout is shorter.
STEP_TIMEOUT = 600
PIP_NETWORK = ["--timeout", "60", "--retries", "2"]
STEPS = 40

# A trainer loop as a user writes one: least squares by gradient descent, each step's loss and
# norms sent with gradwatch.Monitor. Prints what it ran with and what it sent, as JSON; then reads
# the run back through the installed package's own Query stubs.
TRAINER = textwrap.dedent("""
    import json, math, random, sys

    import google.protobuf
    import grpc
    from google.protobuf.internal import api_implementation

    import gradwatch
    from gradwatch.v1 import gradwatch_pb2, gradwatch_pb2_grpc

    address, run, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(7)
    target = [rng.uniform(-1, 1) for _ in range(8)]
    data = [[rng.uniform(-1, 1) for _ in range(8)] for _ in range(32)]
    w, bias, lr = [0.0] * 8, [0.0], 0.1
    losses = []
    with gradwatch.Monitor(run, address=address, config={"weight_decay": 0.0},
                           params=[{"name": "linear.weight", "numel": 8}, {"name": "linear.bias", "numel": 1}]) as mon:
        for step in range(1, steps + 1):
            errors = [sum(a * b for a, b in zip(w, x)) + bias[0] - sum(a * b for a, b in zip(target, x)) for x in data]
            loss = sum(e * e for e in errors) / len(data)
            grad_w = [2 * sum(e * x[i] for e, x in zip(errors, data)) / len(data) for i in range(8)]
            grad_b = 2 * sum(errors) / len(data)
            w = [a - lr * g for a, g in zip(w, grad_w)]
            bias[0] -= lr * grad_b
            norm_w = math.sqrt(sum(g * g for g in grad_w))
            losses.append(loss)
            mon.log(step, {"train/loss": loss, "grad/norm/total": math.hypot(norm_w, grad_b),
                           "grad/norm/linear.weight": norm_w, "grad/norm/linear.bias": abs(grad_b),
                           "params/norm/linear.weight": math.sqrt(sum(a * a for a in w)),
                           "params/norm/linear.bias": abs(bias[0]), "optim/learning_rate": lr})
        flushed = mon.flush(60)
    stats = mon.stats()
    with grpc.insecure_channel(address) as channel:
        summary = gradwatch_pb2_grpc.QueryStub(channel).GetRun(gradwatch_pb2.GetRunRequest(run_id=run), timeout=30)
    print(json.dumps({
        "gradwatch": gradwatch.__version__, "gradwatch_file": gradwatch.__file__,
        "grpcio": grpc.__version__, "grpc_file": grpc.__file__,
        "protobuf": google.protobuf.__version__, "protobuf_file": google.protobuf.__file__,
        "protobuf_implementation": api_implementation.Type(), "client": gradwatch.CLIENT_NAME,
        "flushed": flushed, "finished": stats.finished, "acked_through_step": stats.acked_through_step,
        "refused": stats.refused, "dropped": stats.dropped, "errors": stats.errors, "losses": losses,
        "queried_step_count": summary.info.step_count}))
""")

# gradwatch.torch.Watch on a tiny language model, a few optimizer steps.
TORCH_TRAINER = textwrap.dedent("""
    import json, sys

    import torch

    import gradwatch
    import gradwatch.torch as gwt

    address, run, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(3)

    class RMSNorm(torch.nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    model = torch.nn.Sequential()
    model.add_module("embed", torch.nn.Embedding(32, 16))
    model.add_module("mlp", torch.nn.Linear(16, 16))
    model.add_module("final_norm", RMSNorm(16))
    model.add_module("lm_head", torch.nn.Linear(16, 32, bias=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    watch = gwt.Watch(model, optimizer, run=run, address=address)
    losses = []
    for step in range(1, steps + 1):
        tokens = torch.randint(0, 32, (4, 9))
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        watch.step(step, loss=loss)
        optimizer.zero_grad()
        losses.append(loss.item())
    closed = watch.close()
    print(json.dumps({"gradwatch": gradwatch.__version__, "gradwatch_file": gradwatch.__file__,
                      "torch": torch.__version__, "torch_file": torch.__file__, "closed": closed,
                      "losses": losses}))
""")


def clean_env(path: Optional[str] = None) -> Dict[str, str]:
    """This process's environment for a venv's commands: without PYTHONPATH (which points at the
    build tree's package here), nor anything else that would put other modules in front of the
    venv's; pip's own settings (index, certificates) stay. `path`: PATH instead of this one's."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP",
                                                           "PYTHONUSERBASE", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    if path is not None:
        env["PATH"] = path
    return env


def run(cmd: List[str], what: str, env: Optional[Dict[str, str]] = None, cwd: Optional[Path] = None,
        check: bool = True) -> subprocess.CompletedProcess:
    """Runs `cmd` (bounded by STEP_TIMEOUT); fails, with what it printed last, when it fails."""
    try:
        done = subprocess.run([str(c) for c in cmd], env=env if env is not None else clean_env(), cwd=cwd,
                              capture_output=True, text=True, timeout=STEP_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{what}: still running after {STEP_TIMEOUT} s: {cmd}\n{e.stdout or ''}{e.stderr or ''}")
    if check and done.returncode != 0:
        raise AssertionError(f"{what} failed with exit code {done.returncode}: {' '.join(map(str, cmd))}\n"
                             f"--- stdout (end)\n{done.stdout[-4000:]}\n--- stderr (end)\n{done.stderr[-4000:]}")
    return done


def pip_install(venv: Path, args: List[str], what: str, cwd: Path) -> None:
    """pip install into `venv`, binary wheels only: grpcio built from source takes tens of minutes
    here, and a node without a wheel for its platform should hear so rather than wait."""
    done = run([venv / "bin" / "pip", "install", "--only-binary", ":all:", *PIP_NETWORK, *args], what, cwd=cwd,
               check=False)
    if done.returncode != 0:
        raise AssertionError(
            f"{what}: pip install {' '.join(map(str, args))} failed (exit code {done.returncode}). This test "
            f"installs from PyPI through pip's configuration: if pip says it cannot reach the index, PyPI is "
            f"unreachable from here.\n"
            f"--- pip's output (end)\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def installed(venv: Path, cwd: Path) -> Dict[str, str]:
    """Distribution name (lowercase) -> version, as pip lists the venv (system site packages included)."""
    listed = run([venv / "bin" / "pip", "list", "--format", "json"], "pip list", cwd=cwd).stdout
    return {d["name"].lower(): d["version"] for d in json.loads(listed)}


def wheel_files(wheel: Path) -> Dict[str, bytes]:
    with zipfile.ZipFile(wheel) as z:
        return {name: z.read(name) for name in z.namelist()}


def source_files() -> List[str]:
    """Every file under client/python, to show a build wrote none there."""
    return sorted(str(Path(d, f).relative_to(PROJECT)) for d, _, files in os.walk(PROJECT) for f in files
                  if "__pycache__" not in Path(d).parts)


class PackageTest(unittest.TestCase):
    """One sdist and two wheels (from the source tree, from the sdist), built once for every test,
    and one daemon, each test with its own run."""

    tmp: Path
    tools: Path
    sdist: Path
    wheel: Path
    source_wheel: Path
    daemon: Daemon

    @classmethod
    def setUpClass(cls) -> None:
        cls.tmp = Path(tempfile.mkdtemp(prefix="gradwatch-package-"))
        try:
            cls.build_distributions()
            cls.daemon = Daemon()
        except BaseException:
            shutil.rmtree(cls.tmp, ignore_errors=True)
            raise

    @classmethod
    def tearDownClass(cls) -> None:
        cls.daemon.close()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    @classmethod
    def venv(cls, name: str, system_site_packages: bool = False) -> Path:
        path = cls.tmp / name
        run([PYTHON, "-m", "venv", *(["--system-site-packages"] if system_site_packages else []), path],
            f"creating the venv {name}", cwd=cls.tmp)
        return path

    @classmethod
    def build_distributions(cls) -> None:
        before = source_files()
        cls.tools = cls.venv("tools")
        # Fails first and plainly when PyPI is unreachable; and says what is newest there.
        for package in ("grpcio", "protobuf"):
            probe = run([cls.tools / "bin" / "pip", "index", "versions", package, *PIP_NETWORK],
                        f"asking PyPI for {package}'s versions", cwd=cls.tmp, check=False)
            if probe.returncode != 0:
                raise AssertionError(f"PyPI is unreachable through pip (pip index versions {package} failed): "
                                     f"this test installs the package's dependencies from PyPI.\n"
                                     f"{probe.stdout[-2000:]}{probe.stderr[-2000:]}")
            print(f"PyPI: {probe.stdout.splitlines()[0]}", flush=True)
        pip_install(cls.tools, ["build"], "installing the build frontend", cls.tmp)

        python = cls.tools / "bin" / "python"
        dist = cls.tmp / "dist"
        run([python, "-m", "build", "--sdist", "--outdir", dist, PROJECT], "building the sdist from the source tree",
            cwd=cls.tmp)
        run([python, "-m", "build", "--wheel", "--outdir", cls.tmp / "dist-source", PROJECT],
            "building the wheel from the source tree", cwd=cls.tmp)
        after = source_files()
        if after != before:
            raise AssertionError(f"the builds wrote into client/python: {sorted(set(after) ^ set(before))}")
        (cls.sdist,) = dist.glob("gradwatch-*.tar.gz")
        (cls.source_wheel,) = (cls.tmp / "dist-source").glob("gradwatch-*.whl")

        # The sdist's wheel as a GPU node builds it: no protoc, no grpc_python_plugin on PATH.
        unpacked = cls.tmp / "unpacked"
        with tarfile.open(cls.sdist) as tar:
            tar.extractall(unpacked)  # our own archive, just built
        (sdist_root,) = unpacked.iterdir()
        bare_path = str(cls.tools / "bin")
        for tool in ("protoc", "grpc_python_plugin"):
            if shutil.which(tool, path=bare_path) is not None:
                raise AssertionError(f"{tool} is in {bare_path}: the sdist's build would not show it needs none")
        run([python, "-m", "build", "--wheel", "--outdir", dist, sdist_root], "building the wheel from the sdist",
            env=clean_env(path=bare_path), cwd=cls.tmp)
        (cls.wheel,) = dist.glob("gradwatch-*.whl")

    def declared(self) -> email.message.Message:
        return email.message_from_bytes(wheel_files(self.wheel)[f"gradwatch-{self.version()}.dist-info/METADATA"])

    @staticmethod
    def version() -> str:
        return (REPOSITORY / "VERSION").read_text().strip()

    def oldest(self, package: str) -> str:
        """The lower bound the wheel declares for `package` (Requires-Dist: grpcio<2,>=1.51.1)."""
        for requirement in self.declared().get_all("Requires-Dist"):
            found = re.fullmatch(re.escape(package) + r"\s*\(?[^;]*>=\s*([0-9][0-9.a-z]*)[^;]*", requirement)
            if found:
                return found.group(1)
        raise AssertionError(f"the wheel declares no lower bound for {package}: "
                             f"{self.declared().get_all('Requires-Dist')}")

    def run_trainer(self, venv: Path, script: str, run_id: str, steps: int) -> dict:
        """Runs `script` with the venv's python, from a directory that holds nothing else (so the
        package can only come from the venv), PYTHONPATH unset; its JSON output."""
        workdir = Path(tempfile.mkdtemp(prefix=f"{run_id}-", dir=self.tmp))
        (workdir / "trainer.py").write_text(script)
        done = run([venv / "bin" / "python", "trainer.py", self.daemon.address, run_id, str(steps)],
                   f"the trainer ({run_id})", cwd=workdir)
        out = json.loads(done.stdout.strip().splitlines()[-1])
        self.assertTrue(out["gradwatch_file"].startswith(str(venv)), out["gradwatch_file"])
        self.assertEqual(out["gradwatch"], self.version())
        return out

    def check_trainer_run(self, venv: Path, run_id: str) -> dict:
        """A trainer loop from `venv`, and the daemon holding every one of its steps."""
        out = self.run_trainer(venv, TRAINER, run_id, STEPS)
        print(f"{run_id}: gradwatch {out['gradwatch']}, grpcio {out['grpcio']}, protobuf {out['protobuf']} "
              f"({out['protobuf_implementation']})", flush=True)
        for module in ("grpc_file", "protobuf_file"):
            self.assertTrue(out[module].startswith(str(venv)), out[module])
        self.assertEqual(out["client"], f"gradwatch-python/{self.version()}")
        self.assertTrue(out["flushed"])
        self.assertTrue(out["finished"])
        self.assertEqual((out["acked_through_step"], out["refused"], out["dropped"], out["errors"]), (STEPS, 0, 0, 0))
        self.assertEqual(out["queried_step_count"], STEPS)

        summary = self.daemon.run(run_id)
        self.assertEqual(summary.info.state, pb.RUN_STATE_FINISHED)
        self.assertEqual(summary.info.step_count, STEPS)
        self.assertEqual({p.name for p in summary.params}, {"linear.weight", "linear.bias"})
        losses = self.daemon.points(run_id, "train/loss")
        self.assertEqual([p.step for p in losses], list(range(1, STEPS + 1)))
        for point, loss in zip(losses, out["losses"]):
            self.assertAlmostEqual(point.value, loss, places=12)
        self.assertLess(out["losses"][-1], out["losses"][0])  # it did train
        return out

    # ---- the distributions ----------------------------------------------------------------------

    def test_sdist_and_wheels_carry_the_stubs_and_the_projects_version(self) -> None:
        version = self.version()
        with tarfile.open(self.sdist) as tar:
            names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        for name in ("PKG-INFO", "pyproject.toml", "build_backend/gradwatch_backend.py", "gradwatch/_version.py",
                     "gradwatch/v1/__init__.py", "gradwatch/v1/gradwatch_pb2.py", "gradwatch/v1/gradwatch_pb2_grpc.py"):
            self.assertIn(name, names)
        self.assertEqual(self.sdist.name, f"gradwatch-{version}.tar.gz")
        self.assertEqual(self.wheel.name, f"gradwatch-{version}-py3-none-any.whl")

        from_sdist, from_source = wheel_files(self.wheel), wheel_files(self.source_wheel)
        self.assertEqual(sorted(from_sdist), sorted(from_source))
        for name in from_sdist:
            self.assertEqual(from_sdist[name], from_source[name], name)
        packaged = sorted(n for n in from_sdist if n.startswith("gradwatch/"))
        self.assertEqual(packaged, sorted(["gradwatch/__init__.py", "gradwatch/_catalog.py", "gradwatch/_monitor.py",
                                           "gradwatch/_version.py", "gradwatch/torch.py", "gradwatch/v1/__init__.py",
                                           "gradwatch/v1/gradwatch_pb2.py", "gradwatch/v1/gradwatch_pb2_grpc.py"]))
        self.assertIn(f'__version__ = "{version}"', from_sdist["gradwatch/_version.py"].decode())
        metadata = self.declared()
        self.assertEqual(metadata["Version"], version)
        requires = metadata.get_all("Requires-Dist")
        print(f"the wheel requires: {requires}", flush=True)
        self.assertEqual(sorted(r.split("<")[0].split(">")[0].split(";")[0].strip() for r in requires),
                         ["grpcio", "protobuf", "torch"])
        self.assertTrue(any(r.startswith("torch") and 'extra == "torch"' in r for r in requires), requires)

    def test_a_source_tree_build_without_protoc_names_the_packages_to_install(self) -> None:
        done = run([self.tools / "bin" / "python", "-m", "build", "--sdist", "--outdir", self.tmp / "no-protoc",
                    PROJECT], "building without protoc", env=clean_env(path=str(self.tools / "bin")), cwd=self.tmp,
                   check=False)
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("protoc not found on PATH", done.stdout + done.stderr)
        self.assertIn("apt-get install protobuf-compiler protobuf-compiler-grpc", done.stdout + done.stderr)

    def test_a_protoc_newer_than_the_oldest_protobuf_declared_is_refused(self) -> None:
        # protoc 25.1 (protobuf 4.25.1's) generates code the oldest protobuf declared cannot read.
        newer = self.tmp / "newer-protoc"
        newer.mkdir()
        for tool, body in (("protoc", 'echo "libprotoc 25.1"'), ("grpc_python_plugin", "exit 1")):
            (newer / tool).write_text(f"#!/bin/sh\n{body}\n")
            (newer / tool).chmod(0o755)
        done = run([self.tools / "bin" / "python", "-m", "build", "--sdist", "--outdir", newer / "dist", PROJECT],
                   "building with a newer protoc", env=clean_env(path=f"{newer}:{self.tools / 'bin'}"), cwd=self.tmp,
                   check=False)
        self.assertNotEqual(done.returncode, 0)
        self.assertIn(f"is libprotoc 25.1, newer than the oldest protobuf this package declares "
                      f"({self.oldest('protobuf')})", done.stdout + done.stderr)

    # ---- installed from PyPI into clean venvs ---------------------------------------------------

    def test_newest_grpcio_and_protobuf(self) -> None:
        venv = self.venv("newest")
        pip_install(venv, [self.wheel], "installing the wheel at the newest dependencies", self.tmp)
        versions = installed(venv, self.tmp)
        print(f"newest: installed {sorted(versions.items())}", flush=True)
        out = self.check_trainer_run(venv, "package-newest")
        self.assertEqual((out["grpcio"], out["protobuf"]), (versions["grpcio"], versions["protobuf"]))

    def test_oldest_declared_grpcio_and_protobuf(self) -> None:
        grpcio, protobuf = self.oldest("grpcio"), self.oldest("protobuf")
        venv = self.venv("oldest")
        pip_install(venv, [self.wheel, f"grpcio=={grpcio}", f"protobuf=={protobuf}"],
                    "installing the wheel at the oldest dependencies it declares", self.tmp)
        print(f"oldest: installed {sorted(installed(venv, self.tmp).items())}", flush=True)
        out = self.check_trainer_run(venv, "package-oldest")
        self.assertEqual((out["grpcio"], out["protobuf"]), (grpcio, protobuf))

    # ---- the torch extra, with Debian's torch ---------------------------------------------------

    def test_torch_extra_with_debians_torch(self) -> None:
        venv = self.venv("torch", system_site_packages=True)
        # pip may take Debian's torch or nothing: never PyPI's (several GB), whatever the extra says.
        debian_torch = run([venv / "bin" / "python", "-c",
                            "import importlib.metadata as m; print(m.version('torch'))"],
                           "reading Debian's torch version (python3-torch)", cwd=self.tmp).stdout.strip()
        constraints = self.tmp / "torch-constraints.txt"
        constraints.write_text(f"torch=={debian_torch}\n")
        pip_install(venv, ["--constraint", constraints, f"{self.wheel}[torch]"],
                    "installing gradwatch[torch] next to Debian's torch", self.tmp)
        versions = installed(venv, self.tmp)
        print(f"torch venv: grpcio {versions['grpcio']}, protobuf {versions['protobuf']}, torch {versions['torch']}",
              flush=True)

        steps = 8
        out = self.run_trainer(venv, TORCH_TRAINER, "package-torch", steps)
        self.assertTrue(out["torch_file"].startswith("/usr/lib/python3/dist-packages/"), out["torch_file"])
        self.assertTrue(out["closed"])
        summary = self.daemon.run("package-torch")
        self.assertEqual(summary.info.state, pb.RUN_STATE_FINISHED)
        self.assertEqual(summary.info.step_count, steps)
        params = {p.name: p for p in summary.params}
        self.assertEqual(params["final_norm.weight"].kind, pb.PARAM_KIND_NORM_GAIN)
        self.assertEqual(params["lm_head.weight"].kind, pb.PARAM_KIND_OUTPUT)
        losses = self.daemon.points("package-torch", "train/loss")
        self.assertEqual([p.step for p in losses], list(range(1, steps + 1)))
        for point, loss in zip(losses, out["losses"]):
            self.assertAlmostEqual(point.value, loss, places=5)
        self.assertEqual([p.step for p in self.daemon.points("package-torch", "grad/norm/lm_head.weight")],
                         list(range(1, steps + 1)))


if __name__ == "__main__":
    unittest.main()
