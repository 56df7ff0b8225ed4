"""The container, built and run: an image of the binaries this build made (deploy/container/
Dockerfile.binaries, no second compile) on a Debian 12 base made here from Debian's packages
(debootstrap into a folder, then `docker import`: no registry image can be pulled), gradwatchd run in
it with a Docker volume for its data, a run streamed into it from the host, /metrics scraped, the
container stopped and started again, and every step found.

Docker: the daemon DOCKER_HOST (or the default socket) names when `docker info` answers; otherwise,
as root with Debian's docker.io installed, a private dockerd of the test's own (its data, socket and
state in a temporary folder, no bridge and no iptables rules: the container shares the host's
network and listens on loopback only). When neither can run, the test says why and exits 77, which
ctest reports as skipped, never as passed.

The Debian base is kept in $XDG_CACHE_HOME/gradwatch (default ~/.cache/gradwatch), named by a hash
of its package list and suite, so that only the first run pays for debootstrap.

Run directly: /usr/bin/python3 test_container.py. Environment: GRADWATCHD_PATH, GRADWATCH_CLI_PATH,
GRADWATCH_TEST_TIME_SCALE, GRADWATCH_DEBIAN_MIRROR (default: the first Debian archive apt uses).
"""

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

from stack import SCALE, free_port, wait_for

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DAEMON = os.environ.get("GRADWATCHD_PATH", "gradwatchd")
CLI = os.environ.get("GRADWATCH_CLI_PATH", "gradwatch")
CONTAINER = os.path.join(ROOT, "deploy", "container")
SUITE = "bookworm"
RUN = "container-run"
SKIPPED = 77


def runtime_packages():
    with open(os.path.join(CONTAINER, "runtime-packages.txt")) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def debian_mirror():
    """The first Debian archive (not the security one) in apt's sources."""
    if os.environ.get("GRADWATCH_DEBIAN_MIRROR"):
        return os.environ["GRADWATCH_DEBIAN_MIRROR"]
    for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*"))]:
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            continue
        for uri in re.findall(r"(?m)^(?:URIs:\s*|deb\s+(?:\[[^\]]*\]\s+)?)(https?://\S+)", text):
            if "security" not in uri:
                return uri
    return "http://deb.debian.org/debian"


def docker(env, *args, timeout=300, check=True, **kwargs):
    out = subprocess.run(["docker", *args], env=env, capture_output=True, text=True, timeout=timeout * SCALE, **kwargs)
    if check and out.returncode != 0:
        raise AssertionError(f"docker {' '.join(args[:3])}... failed ({out.returncode}): {out.stdout}{out.stderr}")
    return out


def docker_answers(env):
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def entrypoint(dockerfile):
    with open(dockerfile) as f:
        (line,) = [line for line in f if line.startswith("ENTRYPOINT ")]
    return json.loads(line[len("ENTRYPOINT "):])


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()
    except OSError:
        return None


def last_step(metrics_text):
    m = re.search(r'^gradwatch_last_step\{[^}]*run="' + RUN + r'"[^}]*\} (\S+)$', metrics_text or "", re.M)
    return float(m.group(1)) if m else None


class ContainerBuiltAndRun(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="gw-ctr-")
        cls.env = dict(os.environ, DOCKER_BUILDKIT="0")
        cls.dockerd = None
        cls.skip_reason = None
        if not docker_answers(cls.env):
            cls.skip_reason = cls._start_private_dockerd()

    @classmethod
    def _start_private_dockerd(cls):
        """None when a private dockerd answers, else why none can run here."""
        dockerd = shutil.which("dockerd") or ("/usr/sbin/dockerd" if os.path.exists("/usr/sbin/dockerd") else None)
        if dockerd is None or shutil.which("docker") is None:
            return "no Docker daemon answers and dockerd/docker are not installed (Debian: docker.io)"
        if os.geteuid() != 0:
            return "no Docker daemon answers and a private dockerd needs root"
        sock = os.path.join(cls.dir, "d.sock")
        cls.dockerd_log = os.path.join(cls.dir, "dockerd.log")
        log = open(cls.dockerd_log, "w")
        cls.dockerd = subprocess.Popen(
            [dockerd, "--data-root", os.path.join(cls.dir, "root"), "--exec-root", os.path.join(cls.dir, "x"),
             "--host", f"unix://{sock}", "--pidfile", os.path.join(cls.dir, "dockerd.pid"),
             "--bridge", "none", "--iptables=false", "--ip-masq=false", "--userland-proxy=false"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        cls.env["DOCKER_HOST"] = f"unix://{sock}"
        deadline = time.monotonic() + 90 * SCALE
        while time.monotonic() < deadline:
            if cls.dockerd.poll() is not None:
                break
            if docker_answers(cls.env):
                return None
            time.sleep(0.5)
        cls._stop_private_dockerd()
        with open(cls.dockerd_log) as f:
            tail = "".join(f.readlines()[-5:])
        return f"no Docker daemon answers, and a private dockerd did not start here:\n{tail}"

    @classmethod
    def _stop_private_dockerd(cls):
        if cls.dockerd is None:
            return
        if cls.dockerd.poll() is None:
            cls.dockerd.terminate()
            try:
                cls.dockerd.wait(timeout=60)
            except subprocess.TimeoutExpired:
                cls.dockerd.kill()
                cls.dockerd.wait()
        cls.dockerd = None

    @classmethod
    def tearDownClass(cls):
        cls._stop_private_dockerd()
        # What a stopped dockerd leaves mounted under its state (its network namespace's bind mount).
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1] for line in f if line.split()[1].startswith(cls.dir + "/")]
        for mount in sorted(mounts, reverse=True):
            subprocess.run(["umount", "--lazy", mount], capture_output=True)
        shutil.rmtree(cls.dir, ignore_errors=True)

    def setUp(self):
        if self.skip_reason:
            self.skipTest(self.skip_reason)
        self.tag = f"gw-test-{os.getpid()}"
        self.addCleanup(self._remove_docker_objects)

    def _remove_docker_objects(self):
        docker(self.env, "rm", "-f", self.tag, check=False)
        docker(self.env, "volume", "rm", "-f", self.tag, check=False)
        docker(self.env, "image", "rm", "-f", f"{self.tag}:image", check=False)

    def base_image(self):
        """A Debian 12 image holding runtime-packages.txt, made with debootstrap (cached) and imported."""
        packages = runtime_packages()
        mirror = debian_mirror()
        key = hashlib.sha256("\n".join([SUITE, *packages]).encode()).hexdigest()[:16]
        name = f"gradwatch-test-base:{key}"
        if docker(self.env, "image", "inspect", name, check=False).returncode == 0:
            return name
        cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "gradwatch")
        tarball = os.path.join(cache, f"container-base-{SUITE}-{key}.tar")
        if not os.path.exists(tarball):
            if shutil.which("debootstrap") is None and not os.path.exists("/usr/sbin/debootstrap"):
                self.fail("debootstrap is not installed (Debian: debootstrap; deploy/packages-test.txt lists it)")
            rootfs = os.path.join(self.dir, "rootfs")
            print(f"debootstrap {SUITE} from {mirror} with {len(packages)} runtime packages (cached after)",
                  file=sys.stderr, flush=True)
            started = time.monotonic()
            out = subprocess.run(["debootstrap", "--variant=minbase", "--include=" + ",".join(packages), SUITE, rootfs,
                                  mirror], capture_output=True, text=True, timeout=1200 * SCALE)
            if out.returncode != 0:
                self.fail(f"debootstrap failed ({out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
            print(f"debootstrap took {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
            shutil.rmtree(os.path.join(rootfs, "var", "cache", "apt", "archives"), ignore_errors=True)
            os.makedirs(cache, exist_ok=True)
            partial = tarball + f".{os.getpid()}.partial"
            subprocess.run(["tar", "-C", rootfs, "--numeric-owner", "-cf", partial, "."], check=True,
                           timeout=600 * SCALE)
            os.replace(partial, tarball)
            shutil.rmtree(rootfs, ignore_errors=True)
        with open(tarball, "rb") as f:
            docker(self.env, "import", "-", name, stdin=f, timeout=600)
        return name

    def test_an_image_of_the_built_binaries_keeps_every_step_across_a_restart(self):
        base = self.base_image()
        context = os.path.join(self.dir, "context")
        os.makedirs(context)
        for src, name in ((DAEMON, "gradwatchd"), (CLI, "gradwatch"),
                          (os.path.join(ROOT, "deploy", "gradwatchd.yaml"), "gradwatchd.yaml")):
            shutil.copy2(src, os.path.join(context, name))
        image = f"{self.tag}:image"
        docker(self.env, "build", "--network", "host", "-f", os.path.join(CONTAINER, "Dockerfile.binaries"),
               "--build-arg", f"BASE={base}", "-t", image, context, timeout=600)

        # The image's own entrypoint, with its listeners on loopback ports of the shared network.
        argv = entrypoint(os.path.join(CONTAINER, "Dockerfile.binaries"))
        self.assertEqual(argv, entrypoint(os.path.join(CONTAINER, "Dockerfile")),
                         "Dockerfile.binaries runs gradwatchd as the Dockerfile does")
        grpc_port, metrics_port = free_port(), free_port()
        args = [a.replace("0.0.0.0:7390", f"127.0.0.1:{grpc_port}").replace("0.0.0.0:9390", f"127.0.0.1:{metrics_port}")
                for a in argv[1:]]
        docker(self.env, "volume", "create", self.tag)
        docker(self.env, "run", "-d", "--name", self.tag, "--network", "host",
               "-v", f"{self.tag}:/var/lib/gradwatch", "--entrypoint", argv[0], image, *args)
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        self.wait_serving(metrics)
        user = docker(self.env, "exec", self.tag, "id", "-u").stdout.strip()
        self.assertEqual(user, "10001", "gradwatchd runs as the image's unprivileged user")

        # A run streamed in from the host.
        history = os.path.join(self.dir, "run.jsonl")
        subprocess.run([sys.executable, os.path.join(ROOT, "deploy", "examples", "make_incident_run.py"), "--out",
                        history, "--from-step", "50000", "--to-step", "59990", "--every", "10"], check=True)
        with open(history) as f:
            header = json.loads(f.readline())
            steps = [json.loads(line)["_step"] for line in f if '"event"' not in line]
        replay = subprocess.run([CLI, "--addr", f"127.0.0.1:{grpc_port}", "replay", history, "--run", RUN, "--max"],
                                capture_output=True, text=True, timeout=600 * SCALE)
        self.assertEqual(replay.returncode, 0, f"replay: {replay.stdout}{replay.stderr}")
        self.assertTrue(header)
        wait_for(lambda: last_step(get(metrics)) == steps[-1], 60, f"/metrics to show step {steps[-1]} of {RUN}")

        # Stopped (SIGTERM, as `docker stop` sends) and started again: every step is still there.
        docker(self.env, "stop", "--time", "60", self.tag, timeout=120)
        state = json.loads(docker(self.env, "inspect", self.tag).stdout)[0]["State"]
        self.assertEqual(state["ExitCode"], 0, f"gradwatchd's exit on docker stop: {state}")
        docker(self.env, "start", self.tag)
        self.wait_serving(metrics)
        wait_for(lambda: last_step(get(metrics)) == steps[-1], 60, f"the restarted daemon to show step {steps[-1]}")
        api = f"http://127.0.0.1:{metrics_port}/api/v1/runs/{RUN}/series?key=grad/norm/total&max_points=100000"
        points = json.loads(get(api) or "{}").get("points", [])
        self.assertEqual([int(p["step"]) for p in points], steps, "every step streamed before the restart")
        logs = docker(self.env, "logs", self.tag).stdout + docker(self.env, "logs", self.tag).stderr
        self.assertNotIn('"level":"error"', logs)

    def wait_serving(self, metrics):
        def up():
            state = docker(self.env, "inspect", "-f", "{{.State.Running}}", self.tag, check=False).stdout.strip()
            if state == "false":
                logs = docker(self.env, "logs", self.tag, check=False)
                raise AssertionError(f"the container stopped:\n{logs.stdout[-3000:]}{logs.stderr[-3000:]}")
            return get(metrics) is not None
        wait_for(up, 120, f"gradwatchd in the container to serve {metrics}")


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=2).result
    if not result.wasSuccessful():
        sys.exit(1)
    if result.skipped:
        for _, reason in result.skipped:
            print(f"SKIPPED: {reason}", file=sys.stderr)
        sys.exit(SKIPPED)
