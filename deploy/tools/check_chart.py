#!/usr/bin/env python3
"""Validates deploy/: renders the Helm chart with Helm's own Go engine (Helm 4
through helm-python-sdk's C binding), lints it, checks values.schema.json
rejects bad values, validates every rendered object and the plain manifest
against the official Kubernetes JSON schemas (kubernetes-validate, strict:
unknown fields are errors) for several Kubernetes versions, checks RBAC is
least privilege, and checks deploy/kubernetes/dataplane.yaml is the chart's
default rendering.

    check_chart.py                # check; exit 1 with a report on failure
    check_chart.py --write        # regenerate deploy/kubernetes/dataplane.yaml

Needs: pip install helm-python-sdk==0.2.2 kubernetes-validate==1.37.0
(the integration test tests/tests/kube_deploy.rs sets up a venv with them).
"""

import argparse
import json
import pathlib
import sys

import helm_python as helm
import kubernetes_validate
import yaml

DEPLOY = pathlib.Path(__file__).resolve().parent.parent
CHART = DEPLOY / "helm" / "dataplane"
MANIFEST = DEPLOY / "kubernetes" / "dataplane.yaml"
RELEASE = "dataplane"
NAMESPACE = "dataplane-system"
# The oldest version the chart declares (kubeVersion >=1.26), a middle one,
# and the newest schemas shipped.
KUBERNETES_VERSIONS = ["1.26.0", "1.30.0", "1.33.0", "1.37.0"]

# Values that switch every optional branch of the templates.
VARIANTS = {
    "defaults": {},
    "shared-ca-and-options": {
        "ca": {"secretName": "dataplane-ca"},
        "imagePullSecrets": [{"name": "regcred"}],
        "agent": {"failOpen": True, "extraArgs": ["--proxy-mark=0x540"],
                  "dnsCapture": True, "dnsUpstream": ["10.96.0.10", "[fd00::a]:53"],
                  "extraEnv": [{"name": "EXTRA", "value": "1"}]},
        "cni": {"confFile": "10-calico.conflist", "onAgentUnreachable": "pass",
                "kubeconfig": False},
        "podAnnotations": {"example.com/a": "b"},
        "podLabels": {"team": "mesh"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "mesh", "operator": "In", "values": ["yes"]}]}]}}},
        "serviceAccount": {"annotations": {"example.com/role": "mesh"}},
    },
    # A node booted with ipv6.disable=1: every address IPv4.
    "ipv4-only": {"agent": {"ipv6Enabled": False}},
    "istio": {
        "istio": {"enabled": True, "address": "istiod.istio-system.svc:15012",
                  "certSource": "istio", "clusterId": "east"},
    },
    # A revision's mesh config, and proxy metadata as Istio's ztunnel chart
    # renders it.
    "istio-revision": {
        "istio": {"enabled": True, "meshConfigMap": "istio-canary",
                  "proxyMetadata": {"ISTIO_META_DNS_CAPTURE": "false", "POOL_MAX_STREAMS_PER_CONNECTION": "50"}},
    },
    # In istio-cni's place beside Istio's ztunnel, with a socket directory
    # other than the default so the value is seen to reach the hostPath.
    "ztunnel": {
        "agent": {"engine": "ztunnel"},
        "ztunnel": {"socketDir": "/run/istio-ztunnel", "ackTimeout": "3s"},
    },
    "no-cni-no-rbac": {
        "cni": {"enabled": False},
        "rbac": {"create": False},
        "serviceAccount": {"create": False, "name": "existing"},
        "readinessProbe": {"enabled": False},
        "metrics": {"enabled": False},
        "fullnameOverride": "mesh-node",
    },
}

BAD_VALUES = [
    {"cni": {"onAgentUnreachable": "maybe"}},
    {"agent": {"onExit": "explode"}},
    {"host": {"bpffs": "relative/path"}},
    {"readinessProbe": {"port": 70000}},
    {"metrics": {"port": 0}},
    {"agent": {"drainTimeout": "soon"}},
    {"unknownKey": 1},
    {"istio": {"certSource": "vault"}},
    {"istio": {"address": "istiod"}},
    {"agent": {"engine": "envoy"}},
    {"ztunnel": {"ackTimeout": "soon"}},
    {"ztunnel": {"socketDir": "relative/dir"}},
    {"istio": {"meshConfigMap": "Not_A_Name"}},
    {"istio": {"proxyMetadata": {"ISTIO_META_A": 1}}},
]

# Values the schema lets through but the chart refuses to render (`fail`).
REFUSED_VALUES = [
    # ztunnel owns the sockets: no hand-over, so a surge pod never starts.
    {"agent": {"engine": "ztunnel"},
     "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}},
]


def render(values):
    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for name in sorted(rendered):
        if not name.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.safe_load_all(rendered[name]):
            if doc:
                docs.append(doc)
    return docs


def validate(doc, problems, where):
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            problems.append(f"{where}: {doc.get('kind')} {doc['metadata'].get('name')} "
                            f"invalid for Kubernetes {version}: {err.message} at {list(err.path)}")


def check_rbac(docs, problems, where):
    for doc in docs:
        if doc["kind"] in ("ClusterRole", "Role"):
            rules = doc.get("rules", [])
            granted = sorted((g, r, v) for rule in rules for g in rule.get("apiGroups", [])
                             for r in rule.get("resources", []) for v in rule.get("verbs", []))
            wanted = sorted([("", r, v) for r in ("pods", "namespaces") for v in ("get", "list", "watch")]
                            + [("", "pods/status", "patch")])
            if granted != wanted:
                problems.append(f"{where}: {doc['kind']} grants {granted}, want exactly {wanted}")


def seconds(duration):
    """A chart duration (`20s`, `1m`, `500ms`, bare seconds) in seconds."""
    for suffix, factor in (("ms", 0.001), ("s", 1), ("m", 60), ("h", 3600), ("d", 86400)):
        if duration.endswith(suffix) and duration[: -len(suffix)].isdigit():
            return int(duration[: -len(suffix)]) * factor
    return int(duration)


def check_daemonset(docs, problems, where, values):
    daemonsets = [d for d in docs if d["kind"] == "DaemonSet"]
    if len(daemonsets) != 1:
        problems.append(f"{where}: {len(daemonsets)} DaemonSets")
        return
    pod = daemonsets[0]["spec"]["template"]["spec"]
    agent = next(c for c in pod["containers"] if c["name"] == "agent")
    if not agent.get("securityContext", {}).get("privileged"):
        problems.append(f"{where}: the agent must be privileged")
    mounts = {m["mountPath"] for m in agent["volumeMounts"]}
    for needed in ("/sys/fs/bpf", "/host/sys/fs/cgroup", "/var/run/netns", "/run/dataplane"):
        if needed not in mounts:
            problems.append(f"{where}: agent lacks the mount {needed}")
    if not agent.get("resources", {}).get("requests"):
        problems.append(f"{where}: agent has no resource requests")
    # Surge rollouts: a hostNetwork pod's container ports are host ports,
    # and the scheduler refuses a second pod on the node declaring them.
    if pod.get("hostNetwork") and any(c.get("ports") for c in pod["containers"]):
        problems.append(f"{where}: hostNetwork containers declare ports (they block a surge pod)")
    probe_on = values.get("readinessProbe", {}).get("enabled", True)
    probe = agent.get("readinessProbe", {}).get("exec", {}).get("command", [])
    if probe_on and probe[:3] != ["/usr/local/bin/dataplane", "ready", "--same-cgroup"]:
        problems.append(f"{where}: readiness is not `dataplane ready --same-cgroup`: {probe}")
    # The agent's own wildcard: dual-stack unless IPv6 is off.
    ipv6 = values.get("agent", {}).get("ipv6Enabled", True)
    wildcard = "[::]" if ipv6 else "0.0.0.0"
    env = {e["name"]: e.get("value") for e in agent.get("env", [])}
    if env.get("DATAPLANE_IPV6_ENABLED") != ("true" if ipv6 else "false"):
        problems.append(f"{where}: DATAPLANE_IPV6_ENABLED is not agent.ipv6Enabled")
    if probe_on and f"--readiness-addr={wildcard}:15021" not in agent["args"]:
        problems.append(f"{where}: readiness not on {wildcard}:15021")
    metrics_on = values.get("metrics", {}).get("enabled", True)
    if metrics_on and f"--metrics-addr={wildcard}:15020" not in agent["args"]:
        problems.append(f"{where}: metrics not on {wildcard}:15020")
    rolling = daemonsets[0]["spec"].get("updateStrategy", {}).get("rollingUpdate", {})
    ztunnel = values.get("agent", {}).get("engine") == "ztunnel"
    if ztunnel and ("--takeover" in agent["args"] or rolling.get("maxSurge")):
        problems.append(f"{where}: --takeover or a surge rollout under ztunnel (no hand-over there)")
    if not ztunnel and not rolling.get("maxSurge") and "updateStrategy" not in values:
        problems.append(f"{where}: the default rollout does not surge")
    if rolling.get("maxSurge") and not {"--takeover", "--after-handover=wait"} <= set(agent["args"]):
        problems.append(f"{where}: a surge rollout without --takeover and --after-handover=wait")
    drain = next((a.split("=", 1)[1] for a in agent["args"] if a.startswith("--drain-timeout=")), None)
    if drain is None:
        problems.append(f"{where}: no --drain-timeout")
    elif seconds(drain) >= pod.get("terminationGracePeriodSeconds", 30):
        problems.append(f"{where}: drain timeout {drain} does not fit in terminationGracePeriodSeconds "
                        f"{pod.get('terminationGracePeriodSeconds', 30)}")
    check_engine(pod, agent, problems, where, values)
    check_istio(pod, agent, problems, where, values)
    cni_on = values.get("cni", {}).get("enabled", True)
    names = [c["name"] for c in pod["containers"]]
    if cni_on != ("install-cni" in names):
        problems.append(f"{where}: install-cni container presence {names} does not follow cni.enabled")
    if cni_on:
        install = next(c for c in pod["containers"] if c["name"] == "install-cni")
        cmounts = {m["mountPath"] for m in install["volumeMounts"]}
        for needed in ("/host/opt/cni/bin", "/host/etc/cni/net.d"):
            if needed not in cmounts:
                problems.append(f"{where}: install-cni lacks the mount {needed}")


def check_istio(pod, agent, problems, where, values):
    """With istio.enabled, Istio's mesh config (ConfigMap `istio.meshConfigMap`,
    key `mesh`, optional) is mounted at /etc/istio/config, the agent's
    --mesh-config default (/etc/istio/config/mesh, where ztunnel reads
    it), and `istio.proxyMetadata` becomes the agent's environment as Istio's
    ztunnel chart renders meshConfig.defaultConfig.proxyMetadata."""
    istio = values.get("istio", {})
    on = istio.get("enabled", False)
    want_map = istio.get("meshConfigMap", "istio") if on else ""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mount = next((m for m in agent["volumeMounts"] if m["mountPath"] == "/etc/istio/config"), None)
    if not want_map:
        if mount is not None:
            problems.append(f"{where}: a mesh config mounted without istio.enabled and istio.meshConfigMap")
        return
    source = volumes.get(mount["name"], {}).get("configMap") if mount else None
    want = {"name": want_map, "items": [{"key": "mesh", "path": "mesh"}], "optional": True}
    if source != want or not mount.get("readOnly"):
        problems.append(f"{where}: /etc/istio/config is {source!r}, want read-only {want!r}")
    if any(a.startswith("--mesh-config") for a in agent["args"]):
        problems.append(f"{where}: --mesh-config named: a missing optional ConfigMap would stop the agent")
    env = {e["name"]: e.get("value") for e in agent.get("env", [])}
    for key, value in istio.get("proxyMetadata", {}).items():
        if env.get(key) != value:
            problems.append(f"{where}: proxyMetadata {key}={value!r} is {env.get(key)!r} in the agent's environment")


def check_engine(pod, agent, problems, where, values):
    """`agent.engine: ztunnel` serves ZDS on the socket ztunnel looks for
    (ztunnel.sock in the host directory `ztunnel.socketDir`, shared with
    Istio's ztunnel chart) and sees ztunnel's process (hostPID, for
    pidfd_getfd); the default engine mounts no ZDS socket."""
    env = {e["name"]: e.get("value") for e in agent.get("env", [])}
    engine = values.get("agent", {}).get("engine", "builtin")
    if env.get("DATAPLANE_ENGINE") != engine:
        problems.append(f"{where}: DATAPLANE_ENGINE is {env.get('DATAPLANE_ENGINE')!r}, want {engine!r}")
    socket = env.get("DATAPLANE_ZDS_SOCKET")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    if engine != "ztunnel":
        if socket is not None or "ztunnel-sock" in volumes:
            problems.append(f"{where}: a ZDS socket without agent.engine=ztunnel")
        return
    if not pod.get("hostPID"):
        problems.append(f"{where}: engine ztunnel needs hostPID to copy ztunnel's listeners")
    if "DATAPLANE_ZDS_ACK_TIMEOUT" not in env:
        problems.append(f"{where}: engine ztunnel without DATAPLANE_ZDS_ACK_TIMEOUT")
    if socket is None or not socket.endswith("/ztunnel.sock"):
        problems.append(f"{where}: DATAPLANE_ZDS_SOCKET is {socket!r}, not a ztunnel.sock")
        return
    socket_dir = socket.rsplit("/", 1)[0]
    mount = next((m for m in agent["volumeMounts"] if m["mountPath"] == socket_dir), None)
    host_path = volumes.get(mount["name"], {}).get("hostPath", {}).get("path") if mount else None
    want = values.get("ztunnel", {}).get("socketDir", "/var/run/ztunnel")
    if host_path != want:
        problems.append(f"{where}: the ZDS socket's directory {socket_dir} is host {host_path!r}, "
                        f"not ztunnel.socketDir {want!r}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true", help="regenerate the plain manifest")
    args = parser.parse_args()
    problems = []
    report = {"helm": helm.helm_sdk_version(), "kubernetes": KUBERNETES_VERSIONS, "variants": {}}

    lint = helm.lint(str(CHART), strict=True)
    errors = [m for m in lint.get("messages", []) if m.get("severity", 0) >= 2] + list(lint.get("errors") or [])
    # Helm's lint only recommends an icon; anything else is a finding.
    errors = [e for e in errors if "icon is recommended" not in json.dumps(e)]
    if errors:
        problems.append(f"helm lint: {errors}")

    for values in BAD_VALUES:
        try:
            with helm.Chart.load(str(CHART)) as chart:
                chart.validate_schema(values)
            problems.append(f"values.schema.json accepts bad values {values}")
        except helm.HelmError:
            pass
    for values in REFUSED_VALUES:
        try:
            render(values)
            problems.append(f"the chart renders values it must refuse: {values}")
        except helm.HelmError:
            pass

    default_docs = None
    for name, values in VARIANTS.items():
        with helm.Chart.load(str(CHART)) as chart:
            chart.validate_schema(values)
        docs = render(values)
        for doc in docs:
            validate(doc, problems, f"chart[{name}]")
        check_rbac(docs, problems, f"chart[{name}]")
        check_daemonset(docs, problems, f"chart[{name}]", values)
        report["variants"][name] = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
        if name == "defaults":
            default_docs = docs

    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    if args.write:
        header = ("# Generated from deploy/helm/dataplane with default values (release `dataplane`,\n"
                  "# namespace `dataplane-system`) by `deploy/tools/check_chart.py --write`;\n"
                  "# tests/tests/kube_deploy.rs checks the two agree. Apply with\n"
                  "#   kubectl apply -f deploy/kubernetes/dataplane.yaml\n")
        body = yaml.safe_dump_all([namespace] + default_docs, sort_keys=False, default_flow_style=False)
        MANIFEST.write_text(header + "---\n" + body)
        report["written"] = str(MANIFEST)

    manifest_docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    for doc in manifest_docs:
        validate(doc, problems, "manifest")
    check_rbac(manifest_docs, problems, "manifest")
    if manifest_docs[1:] != default_docs or manifest_docs[:1] != [namespace]:
        problems.append("deploy/kubernetes/dataplane.yaml differs from the chart's default rendering: "
                        "run deploy/tools/check_chart.py --write")
    report["manifest"] = [f"{d['kind']}/{d['metadata']['name']}" for d in manifest_docs]
    report["problems"] = problems
    print(json.dumps(report, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
