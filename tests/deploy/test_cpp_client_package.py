"""The C++ client as a team installs it: `cmake --install` of the build into a fresh prefix, then a
program outside the tree (tests/consumer, copied to a temporary folder so that nothing of the source
tree is on its include path) configured with find_package(gradwatch CONFIG REQUIRED) and linked to
gradwatch::client, built, and run against a real gradwatchd: every step it logs is kept and the run
is recorded as finished.

Environment: GRADWATCH_BUILD_DIR (the build to install), GRADWATCHD_PATH, GRADWATCH_TEST_TIME_SCALE.
"""

import json
import os
import shutil
import subprocess
import tempfile
import unittest

from stack import SCALE, get_json, stop_processes, wait_for

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("GRADWATCH_BUILD_DIR", os.path.join(ROOT, "build"))
DAEMON = os.environ.get("GRADWATCHD_PATH", "gradwatchd")
STEPS = 500


def run(args, timeout, **kwargs):
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout * SCALE, **kwargs)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({out.returncode}):\n{out.stdout[-4000:]}{out.stderr[-4000:]}")
    return out


class InstalledCppClient(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="gradwatch-cpp-package-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.prefix = os.path.join(self.dir, "prefix")
        run(["cmake", "--install", BUILD, "--prefix", self.prefix], 300)

    def test_install_tree_holds_headers_library_and_package(self):
        for path in ["include/gradwatch/monitor.h", "include/gradwatch/monitor_set.h", "include/gradwatch/query_client.h",
                     "include/gradwatch/v1/gradwatch.pb.h", "include/gradwatch/v1/gradwatch.grpc.pb.h",
                     "lib/libgradwatch_client.a", "lib/libgradwatch_proto.a",
                     "lib/cmake/gradwatch/gradwatchConfig.cmake", "lib/cmake/gradwatch/gradwatchConfigVersion.cmake",
                     "bin/gradwatchd", "bin/gradwatch"]:
            self.assertTrue(os.path.exists(os.path.join(self.prefix, path)), f"{path} installed")
        headers = os.path.join(self.prefix, "include", "gradwatch")
        for name in os.listdir(headers):
            if name.endswith(".h"):
                with open(os.path.join(headers, name)) as f:
                    text = f.read()
                self.assertNotIn('#include "client/', text, f"{name} includes only installed headers")
                self.assertNotIn('#include "server/', text, f"{name} includes only installed headers")

    def test_an_out_of_tree_program_finds_the_package_builds_and_streams_to_a_real_daemon(self):
        source = os.path.join(self.dir, "consumer")
        shutil.copytree(os.path.join(ROOT, "tests", "consumer"), source)
        build = os.path.join(self.dir, "consumer-build")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        run(["cmake", "-S", source, "-B", build, *generator, f"-DCMAKE_PREFIX_PATH={self.prefix}",
             "-DCMAKE_BUILD_TYPE=Release"], 300)
        with open(os.path.join(build, "CMakeCache.txt")) as f:
            cache = f.read()
        self.assertIn(f"gradwatch_DIR:PATH={self.prefix}/lib/cmake/gradwatch", cache)
        run(["cmake", "--build", build, "--parallel", "2"], 900)

        data = os.path.join(self.dir, "data")
        ready = os.path.join(self.dir, "ready.json")
        log = open(os.path.join(self.dir, "gradwatchd.log"), "w")
        daemon = subprocess.Popen([DAEMON, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--data-dir",
                                   data, "--ready-file", ready], stdout=log, stderr=log)
        self.addCleanup(stop_processes, [daemon], [log])
        wait_for(lambda: os.path.exists(ready) and os.path.getsize(ready) > 0, 60, "gradwatchd's ready file")
        with open(ready) as f:
            ports = json.load(f)

        out = run([os.path.join(build, "trainer"), f"127.0.0.1:{ports['grpc_port']}", "cpp-consumer", str(STEPS)], 300)
        self.assertIn(f"{STEPS} steps durable, acked through {STEPS}", out.stdout)
        api = f"http://127.0.0.1:{ports['metrics_port']}/api/v1/runs/cpp-consumer"
        series = get_json(f"{api}/series?key=grad/norm/total&max_points=100000")
        self.assertEqual([int(p["step"]) for p in series["points"]], list(range(1, STEPS + 1)))
        self.assertAlmostEqual(series["points"][-1]["value"], 0.3 + 0.001 * STEPS)
        summary = get_json(api)
        self.assertEqual(summary["info"]["state"], "RUN_STATE_FINISHED", summary["info"])


if __name__ == "__main__":
    unittest.main()
