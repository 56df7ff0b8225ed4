"""deploy/container/Dockerfile and deploy/k8s/, checked as far as a machine without Docker and
Kubernetes can: the image's runtime packages provide every shared library the built binaries load
(ldd, then dpkg), its build stage uses the project's package list and build script, its entrypoint's
flags are ones gradwatchd accepts; the manifests parse, the sidecar's probes, ports, mounts and
scrape annotations agree with one another and with the image, and the ConfigMap's configuration
and rules pass `gradwatchd --check-config` and `gradwatch rules check`.

Environment: GRADWATCHD_PATH, GRADWATCH_CLI_PATH.
"""

import json
import os
import re
import shutil
import subprocess
import tempfile
import unittest

import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DAEMON = os.environ.get("GRADWATCHD_PATH", "gradwatchd")
CLI = os.environ.get("GRADWATCH_CLI_PATH", "gradwatch")
DOCKERFILE = os.path.join(ROOT, "deploy", "container", "Dockerfile")
K8S = os.path.join(ROOT, "deploy", "k8s")


def dockerfile_stages(path=DOCKERFILE):
    """[(FROM line, [instructions])] with continuation lines joined; ARG lines before the first FROM
    are left out."""
    with open(path) as f:
        text = re.sub(r"\\\n", " ", f.read())
    stages = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append((line, []))
        elif stages:
            stages[-1][1].append(line)
    return stages


def packages_of(binary: str):
    """The Debian packages of the shared libraries `binary` loads."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    paths = sorted({os.path.realpath(p) for p in re.findall(r"=> (/\S+)", out)})
    owners = subprocess.run(["dpkg", "-S", *paths], capture_output=True, text=True).stdout
    packages = {line.split(":")[0] for line in owners.splitlines() if ": " in line}
    # A path dpkg does not know under its real name (/lib versus /usr/lib) is looked up as linked.
    found = {line.split(": ", 1)[1] for line in owners.splitlines() if ": " in line}
    for path in paths:
        if path not in found:
            alias = subprocess.run(["dpkg", "-S", path.replace("/usr/lib/", "/lib/", 1)], capture_output=True,
                                   text=True, check=True).stdout
            packages.add(alias.split(":")[0])
    return packages


class Container(unittest.TestCase):
    def setUp(self):
        self.stages = dockerfile_stages()

    def test_two_stages_on_debian_12_and_a_non_root_runtime(self):
        self.assertEqual(len(self.stages), 2)
        self.assertRegex(self.stages[0][0], r"^FROM debian:12 AS build$")
        self.assertRegex(self.stages[1][0], r"^FROM debian:12-slim$")
        build = " ".join(self.stages[0][1])
        self.assertIn("gw_ensure_packages deploy/packages.txt", build)
        self.assertIn("gw_build", build)
        runtime = self.stages[1][1]
        users = [i.split()[1] for i in runtime if i.startswith("USER ")]
        self.assertEqual(len(users), 1)
        self.assertNotIn(users[0].split(":")[0], ("0", "root"))
        copies = " ".join(i for i in runtime if i.startswith("COPY --from=build"))
        self.assertIn("/build/server/gradwatchd", copies)
        self.assertIn("/build/client/gradwatch", copies)

    def test_runtime_packages_provide_every_library_the_binaries_load(self):
        runtime = " ".join(self.stages[1][1])
        self.assertIn("COPY deploy/container/runtime-packages.txt", runtime)
        self.assertRegex(runtime, r"runtime-packages.txt \| xargs apt-get install -y --no-install-recommends")
        with open(os.path.join(ROOT, "deploy", "container", "runtime-packages.txt")) as f:
            listed = {line.strip() for line in f if line.strip() and not line.startswith("#")}
        for binary in (DAEMON, CLI):
            libs = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
            if re.search(r"lib(asan|tsan|ubsan|clang_rt)", libs):
                self.skipTest(f"{binary} is a sanitizer build; the image's are built without")
        needed = packages_of(DAEMON) | packages_of(CLI)
        missing = sorted(needed - listed)
        self.assertEqual(missing, [], "libraries the binaries load whose packages the image lacks")

    def test_the_image_of_built_binaries_matches_the_runtime_stage(self):
        """Dockerfile.binaries (the container test's image) runs what the Dockerfile's runtime stage
        runs: the same user, volume, ports, config and entrypoint."""
        (binaries,) = dockerfile_stages(os.path.join(ROOT, "deploy", "container", "Dockerfile.binaries"))
        self.assertEqual(binaries[0], "FROM ${BASE}")

        def runtime_shape(instructions):
            keep = ("USER ", "VOLUME ", "EXPOSE ", "ENTRYPOINT ")
            shape = [i for i in instructions if i.startswith(keep)]
            shape += [m.strip() for i in instructions for m in re.findall(r"useradd [^&]*", i)]
            shape += [i.split()[-1] for i in instructions if i.startswith("COPY ") and "gradwatchd.yaml" in i]
            return shape

        self.assertEqual(runtime_shape(binaries[1]), runtime_shape(self.stages[1][1]))

    def test_entrypoint_flags_are_accepted_and_ports_match(self):
        entry = [i for i in self.stages[1][1] if i.startswith("ENTRYPOINT ")]
        self.assertEqual(len(entry), 1)
        argv = json.loads(entry[0][len("ENTRYPOINT "):])
        self.assertEqual(argv[0], "/usr/local/bin/gradwatchd")
        exposed = set()
        for i in self.stages[1][1]:
            if i.startswith("EXPOSE "):
                exposed.update(i.split()[1:])
        self.assertEqual(exposed, {"7390", "9390"})
        self.assertIn("0.0.0.0:7390", argv)
        self.assertIn("0.0.0.0:9390", argv)
        tmp = tempfile.mkdtemp(prefix="gradwatch-container-check-")
        try:
            args = [a.replace("/etc/gradwatch/gradwatchd.yaml", os.path.join(ROOT, "deploy", "gradwatchd.yaml"))
                     .replace("/var/lib/gradwatch", tmp) for a in argv[1:]]
            out = subprocess.run([DAEMON, *args, "--check-config"], capture_output=True, text=True, timeout=60)
            self.assertEqual(out.returncode, 0, out.stderr)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class Kubernetes(unittest.TestCase):
    def setUp(self):
        self.docs = []
        for name in sorted(os.listdir(K8S)):
            with open(os.path.join(K8S, name)) as f:
                self.docs += [d for d in yaml.safe_load_all(f) if d]
        self.by_kind = {}
        for d in self.docs:
            self.by_kind.setdefault(d["kind"], []).append(d)

    def sidecar(self):
        pod = self.by_kind["Job"][0]["spec"]["template"]
        (container,) = [c for c in pod["spec"]["initContainers"] if c["name"] == "gradwatchd"]
        return pod, container

    def test_every_document_is_a_kubernetes_object(self):
        self.assertEqual(sorted(self.by_kind), ["ConfigMap", "Job", "PodMonitor"])
        for d in self.docs:
            self.assertIn("apiVersion", d)
            self.assertTrue(d["metadata"]["name"])

    def test_the_sidecar_runs_beside_the_trainer_with_grpc_probes(self):
        pod, c = self.sidecar()
        self.assertEqual(c["restartPolicy"], "Always", "a native sidecar")
        self.assertEqual(c["image"], "gradwatch:0.1.0")
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        self.assertEqual(ports, {"grpc": 7390, "metrics": 9390})
        self.assertEqual(c["livenessProbe"]["grpc"], {"port": 7390})
        self.assertEqual(c["readinessProbe"]["grpc"], {"port": 7390, "service": "gradwatch.v1.Ingest"})
        self.assertEqual(c["startupProbe"]["grpc"]["port"], 7390)
        self.assertTrue(pod["spec"]["securityContext"]["runAsNonRoot"])
        self.assertEqual(pod["spec"]["securityContext"]["runAsUser"], 10001)
        annotations = pod["metadata"]["annotations"]
        self.assertEqual(annotations["prometheus.io/scrape"], "true")
        self.assertEqual(annotations["prometheus.io/port"], str(ports["metrics"]))
        (trainer,) = pod["spec"]["containers"]
        env = {e["name"]: e["value"] for e in trainer["env"]}
        self.assertEqual(env["GRADWATCH_ADDR"], f"127.0.0.1:{ports['grpc']}")
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        self.assertEqual(volumes[mounts["/etc/gradwatch"]]["configMap"]["name"],
                         self.by_kind["ConfigMap"][0]["metadata"]["name"])
        self.assertIn("/var/lib/gradwatch", mounts)
        monitor = self.by_kind["PodMonitor"][0]["spec"]
        self.assertEqual(monitor["selector"]["matchLabels"], pod["metadata"]["labels"])
        self.assertEqual(monitor["podMetricsEndpoints"][0]["port"], "metrics")

    def test_the_configmap_passes_check_config_and_rules_check(self):
        _, c = self.sidecar()
        data = self.by_kind["ConfigMap"][0]["data"]
        tmp = tempfile.mkdtemp(prefix="gradwatch-k8s-check-")
        try:
            # Lay the ConfigMap out as the pod mounts it, under a temporary /etc/gradwatch.
            etc = os.path.join(tmp, "etc", "gradwatch")
            os.makedirs(os.path.join(etc, "rules"))
            config = data["gradwatchd.yaml"].replace("/etc/gradwatch", etc).replace("/var/lib/gradwatch",
                                                                                    os.path.join(tmp, "data"))
            with open(os.path.join(etc, "gradwatchd.yaml"), "w") as f:
                f.write(config)
            for key, text in data.items():
                if key != "gradwatchd.yaml":
                    with open(os.path.join(etc, "rules", key), "w") as f:
                        f.write(text)
            args = [a.replace("/etc/gradwatch", etc).replace("/var/lib/gradwatch", os.path.join(tmp, "data"))
                    for a in c["args"]]
            out = subprocess.run([DAEMON, *args, "--check-config"], capture_output=True, text=True, timeout=60)
            self.assertEqual(out.returncode, 0, out.stderr)
            shown = json.loads(out.stdout[:out.stdout.rindex("configuration OK")])
            self.assertEqual(shown["listen"], "0.0.0.0:7390")
            self.assertEqual(shown["metrics_listen"], "0.0.0.0:9390")
            self.assertEqual(shown["alerts"]["rule_files"], [os.path.join(etc, "rules", "team-rules.yaml")])
            out = subprocess.run([CLI, "rules", "check", os.path.join(etc, "rules", "team-rules.yaml")],
                                 capture_output=True, text=True, timeout=60)
            self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
