"""The deployment files are valid for the engines that read them: every Kubernetes
manifest against the API schema (kubernetes-validate, offline), the nginx template
with ``nginx -t``, the HAProxy config with ``haproxy -c``; and they say what the
design needs (stable identities, a volume per replica, gRPC probes, a grace period
longer than the drain plus the snapshot, non-root)."""

from __future__ import annotations

import os
import pathlib
import re
import string
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests.scaleout.conftest import proxy_class
from tests.scaleout.proxies import HAPROXY, NGINX

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
TEMPLATE = ROOT / "deploy" / "nginx" / "gradserve.conf.template"
#: A Kubernetes version whose schemas kubernetes-validate ships.
KUBERNETES = "1.33.0"


def manifests() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> list[dict]:
    return [d for d in manifests() if d["kind"] == kind]


@pytest.mark.parametrize("doc", manifests(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_is_valid_kubernetes(doc):
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # raises if not


def test_kustomization_lists_every_manifest():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"
    )


def test_the_statefulset_gives_each_replica_an_identity_a_volume_and_time_to_save():
    (sts,) = by_kind("StatefulSet")
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert "--replica-id=$(POD_NAME)" in args
    state = next(a.split("=", 1)[1] for a in args if a.startswith("--state-dir="))
    claim = spec["volumeClaimTemplates"][0]["metadata"]["name"]
    assert {"name": claim, "mountPath": state} in container["volumeMounts"]
    grace = float(next(a.split("=", 1)[1] for a in args if a.startswith("--grace=")))
    assert pod["terminationGracePeriodSeconds"] >= grace + 60  # drain + snapshot
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["grpc"]["port"] == 50051
    assert pod["securityContext"]["runAsNonRoot"] and container["resources"]["requests"]
    assert container["securityContext"]["readOnlyRootFilesystem"]
    headless = [s for s in by_kind("Service") if s["metadata"]["name"] == spec["serviceName"]]
    assert headless and headless[0]["spec"]["clusterIP"] == "None"
    assert any(p["spec"]["selector"] == spec["selector"] for p in by_kind("PodDisruptionBudget"))


def test_the_replicas_compute_the_same_bits_within_their_cpu_request():
    """One LSTM formulation and elementwise pass, the BLAS threads of the CPU request,
    and as many compute slots as those fill: the flags parse, and agree with the
    request."""
    from gradserve.server.transport.cli import build_parser

    (sts,) = by_kind("StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    flags = build_parser().parse_args(container["args"][1:])
    env = {e["name"]: e.get("value") for e in container["env"]}
    threads, cpus = int(env["OPENBLAS_NUM_THREADS"]), int(container["resources"]["requests"]["cpu"])
    assert flags.lstm_formulation is not None
    assert flags.cpu_step_kernel != "auto"
    assert flags.compute_slots == max(1, cpus // threads)
    if flags.cpu_step_kernel == "native":  # the image carries the steps built ahead of time
        dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
        built = re.search(r"-m gradserve\.kernels\.native (\S+)", dockerfile)
        assert built and f"GRADSERVE_NATIVE_DIR={built.group(1)}" in dockerfile


def test_the_proxy_configmap_is_the_nginx_template():
    (config,) = [c for c in by_kind("ConfigMap") if c["metadata"]["name"] == "gradserve-proxy"]
    assert config["data"]["gradserve.conf.template"].strip() == TEMPLATE.read_text().strip()


def render(env: dict[str, str]) -> str:
    """What the nginx image's envsubst step writes: only these variables replaced."""
    return string.Template(TEMPLATE.read_text()).safe_substitute(env)


@pytest.mark.parametrize(
    "env",
    [
        {  # Kubernetes (deploy/kubernetes/proxy.yaml)
            "NGINX_RESOLVER": "127.0.0.1",
            "GRADSERVE_REPLICA_DOMAIN": ".gradserve.default.svc.cluster.local",
            "GRADSERVE_CREATE_HOST": "gradserve-create.default.svc.cluster.local",
            "GRADSERVE_PORT": "50051",
        },
        {  # docker/compose.yaml
            "NGINX_RESOLVER": "127.0.0.11",
            "GRADSERVE_REPLICA_DOMAIN": "",
            "GRADSERVE_CREATE_HOST": "gradserve-create",
            "GRADSERVE_PORT": "50051",
        },
    ],
    ids=["kubernetes", "compose"],
)
def test_nginx_accepts_the_template(tmp_path, env):
    proxy_class("nginx")
    conf = render(env)
    assert not re.search(r"\$\{", conf)  # every template variable was given
    (tmp_path / "gradserve.conf").write_text(conf)
    (tmp_path / "nginx.conf").write_text(
        f"pid {tmp_path}/nginx.pid;\nerror_log {tmp_path}/error.log;\nevents {{}}\n"
        f"http {{ include {tmp_path}/gradserve.conf; }}\n"
    )
    done = subprocess.run(
        [NGINX, "-t", "-c", str(tmp_path / "nginx.conf"), "-p", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


def test_haproxy_accepts_its_config(tmp_path):
    proxy_class("haproxy")
    source = ROOT / "deploy" / "haproxy"
    cfg = (source / "haproxy.cfg").read_text()
    cfg = cfg.replace("/usr/local/etc/haproxy/replicas.map", str(source / "replicas.map"))
    (tmp_path / "haproxy.cfg").write_text(cfg)
    done = subprocess.run(
        [HAPROXY, "-c", "-f", str(tmp_path / "haproxy.cfg")],
        capture_output=True,
        text=True,
        env={**os.environ, "POD_NAMESPACE": "default"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    prefixes = [line.split()[0] for line in (source / "replicas.map").read_text().splitlines()]
    assert all(f"backend be_{p}\n" in cfg for p in prefixes)


def test_compose_runs_each_replica_with_its_identity_and_volume():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    replicas = {n: s for n, s in services.items() if re.fullmatch(r"gradserve-\d+", n)}
    assert len(replicas) >= 3
    volumes = set()
    for name, service in replicas.items():
        assert service["environment"]["GRADSERVE_REPLICA_ID"] == name
        command = service["command"]
        state = command[command.index("--state-dir") + 1]
        (mount,) = service["volumes"]
        volume, path = mount.split(":")
        assert path == state and volume in compose["volumes"]
        volumes.add(volume)
    assert len(volumes) == len(replicas)  # each its own
    proxy = services["proxy"]
    template = proxy["volumes"][0].split(":")[0]
    assert (ROOT / "docker" / template).resolve() == TEMPLATE
    assert set(proxy["depends_on"]) == set(replicas)
