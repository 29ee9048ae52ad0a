"""Static checks of deploy/: promtool on the Prometheus config and rules, the committed
dashboards equal the generator's output, the Kubernetes manifests against a small schema
(kinds, required fields, label selectors, probes, resources, references between objects,
the embedded policy through ramjet's own loader), and the systemd units through a parser
check and `systemd-analyze verify`. promtool and systemd-analyze are required, not
optional: `make test` installs them (Debian packages prometheus and systemd), and a
machine without them fails here with that message."""

from __future__ import annotations

import configparser
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ramjet.config import parse_policy

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"


def _need(tool: str, package: str) -> str:
    assert Path(tool).is_file(), (
        f"{tool} is missing: `make test` installs it (Debian package {package}; "
        "scripts/system_deps.sh test)"
    )
    return tool


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    if args[0] == PROMTOOL:
        _need(PROMTOOL, "prometheus")
    return subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=cwd)


# -- Prometheus --------------------------------------------------------------------------------


def test_promtool_check_config() -> None:
    r = _run(PROMTOOL, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_promtool_check_rules() -> None:
    files = sorted(str(p) for p in (DEPLOY / "prometheus" / "rules").glob("*.yml"))
    assert len(files) >= 2
    r = _run(PROMTOOL, "check", "rules", *files)
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    """The check above can fail: a rule with a syntax error is refused."""
    bad = tmp_path / "bad.yml"
    bad.write_text("groups:\n  - name: x\n    rules:\n      - record: a:b\n        expr: sum(\n")
    assert _run(PROMTOOL, "check", "rules", str(bad)).returncode != 0


def test_promtool_alert_unit_tests_pass() -> None:
    """deploy/prometheus/tests: input series in, the alerts that must (not) fire out."""
    files = sorted(str(p) for p in (DEPLOY / "prometheus" / "tests").glob("*.test.yml"))
    assert files
    r = _run(PROMTOOL, "test", "rules", *files)
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_alert_unit_test_catches_a_silent_healthy_target(tmp_path: Path) -> None:
    """The unit test above can fail: make e1's pull target silent too and RamjetReportPullSilent
    fires for e1, which the test does not expect."""
    src = DEPLOY / "prometheus" / "tests" / "ramjet-alerts.test.yml"
    text = src.read_text()
    healthy = "values: '0 15 5 20 10 0 15 5 20 10 0 15 5 20 10 0 15 5 20 10 0 15 5 20 10'"
    assert healthy in text
    broken = tmp_path / "broken.test.yml"
    broken.write_text(
        text.replace(healthy, "values: '0+15x24'").replace(
            "../rules/", str(DEPLOY / "prometheus" / "rules") + "/"
        )
    )
    r = _run(PROMTOOL, "test", "rules", str(broken))
    assert r.returncode != 0 and 'engine="e1"' in r.stdout + r.stderr, r.stdout + r.stderr


def test_promtool_alert_unit_test_catches_a_starving_busy_engine(tmp_path: Path) -> None:
    """The starvation test can fail too: let e1's oldest request keep waiting and
    RamjetPriorityStarvation fires for e1, which the test does not expect."""
    src = DEPLOY / "prometheus" / "tests" / "ramjet-alerts.test.yml"
    text = src.read_text()
    busy = "values: '0 15 30 45 55 0 15 30 45 55 0 15 30 45 55 0 15 30 45 55 0 15 30 45 55'"
    assert text.count(busy) == 1
    broken = tmp_path / "broken.test.yml"
    broken.write_text(
        text.replace(busy, "values: '0 15 30 45 55 70 85 100 115 130 145 160 175 190 205'").replace(
            "../rules/", str(DEPLOY / "prometheus" / "rules") + "/"
        )
    )
    r = _run(PROMTOOL, "test", "rules", str(broken))
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "RamjetPriorityStarvation" in out and 'engine="e1"' in out, out


# -- Grafana -----------------------------------------------------------------------------------


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location(
        "generate_dashboards", DEPLOY / "grafana" / "generate_dashboards.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_committed_dashboards_are_the_generated_ones() -> None:
    files = _generator().files()
    on_disk = {p.name for p in (DEPLOY / "grafana" / "dashboards").glob("*.json")}
    assert on_disk == set(files), "run python deploy/grafana/generate_dashboards.py"
    for name, text in files.items():
        assert (DEPLOY / "grafana" / "dashboards" / name).read_text() == text, name


def test_dashboards_cover_the_issue_and_use_the_provisioned_datasource() -> None:
    gen = _generator()
    titles = {d.title for d in gen.DASHBOARDS}
    for part in ("Routing", "Cache", "Observation", "Priority", "Engines", "reports", "Redis"):
        assert any(part in t for t in titles), part
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/ramjet.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    prov = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/ramjet.yml").read_text())
    assert prov["providers"][0]["type"] == "file"
    for d in gen.DASHBOARDS:
        board = gen.render(d)
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
        for p in board["panels"]:
            assert p["description"].strip() and p["targets"], p["title"]
            assert p["datasource"]["uid"] == uid
            assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24


# What priority scheduling needs an operator to see (issue 18's metrics, docs/priority.md):
# a series -> how a panel of "Ramjet / Priority" must read it.
PRIORITY_PANELS = {
    "ramjet_priority_hints_total": "sum by (pool, outcome) (rate(",
    "ramjet_priority_hint_work_seconds_bucket": "sum by (le, pool) (rate(",
    "engine_queue_wait_by_band_seconds_bucket": "sum by (le, engine, band) (rate(",
    "engine_oldest_waiting_seconds": "max by (engine) (",
    "engine_priority_preemptions_total": "sum by (engine) (rate(",
}


def test_priority_dashboard_shows_hints_and_engine_scheduling() -> None:
    gen = _generator()
    board = next(d for d in gen.DASHBOARDS if d.title == "Ramjet / Priority")
    exprs = [e for p in board.panels for e, _ in p.targets]
    for series, shape in PRIORITY_PANELS.items():
        assert any(series in e and shape in e for e in exprs), f"no panel reads {series}"
    quantiles = [e for e in exprs if "ramjet_priority_hint_work_seconds_bucket" in e]
    assert {e.split(",")[0] for e in quantiles} == {
        "histogram_quantile(0.5",
        "histogram_quantile(0.99",
    }


# -- Kubernetes --------------------------------------------------------------------------------

# kind -> (apiVersion, required paths)
K8S_SCHEMA: dict[str, tuple[str, tuple[str, ...]]] = {
    "Namespace": ("v1", ("metadata.name",)),
    "ConfigMap": ("v1", ("metadata.name", "metadata.namespace", "data")),
    "Secret": ("v1", ("metadata.name", "metadata.namespace", "type")),
    "Service": ("v1", ("metadata.name", "metadata.namespace", "spec.selector", "spec.ports")),
    "Deployment": (
        "apps/v1",
        (
            "metadata.name",
            "metadata.namespace",
            "spec.replicas",
            "spec.selector.matchLabels",
            "spec.template.metadata.labels",
            "spec.template.spec.containers",
        ),
    ),
    "PodDisruptionBudget": (
        "policy/v1",
        ("metadata.name", "metadata.namespace", "spec.selector.matchLabels"),
    ),
    "NetworkPolicy": (
        "networking.k8s.io/v1",
        ("metadata.name", "metadata.namespace", "spec.podSelector", "spec.policyTypes"),
    ),
}


def _get(doc: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(doc, dict) or part not in doc:
            return None
        doc = doc[part]
    return doc


def load_manifests(folder: Path) -> list[dict[str, Any]]:
    docs = []
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append({**doc, "_file": path.name})
    return docs


def check_manifests(docs: list[dict[str, Any]]) -> list[str]:
    """Schema and cross-reference errors, as readable lines (empty: valid)."""
    errs: list[str] = []
    by_kind: dict[str, dict[str, dict[str, Any]]] = {}
    for d in docs:
        where = f"{d.get('_file')}: {d.get('kind')}/{_get(d, 'metadata.name')}"
        kind = d.get("kind")
        if kind not in K8S_SCHEMA:
            errs.append(f"{where}: unknown kind")
            continue
        api, required = K8S_SCHEMA[kind]
        if d.get("apiVersion") != api:
            errs.append(f"{where}: apiVersion {d.get('apiVersion')!r}, want {api!r}")
        errs += [f"{where}: missing {p}" for p in required if _get(d, p) in (None, "", [], {})]
        by_kind.setdefault(kind, {})[_get(d, "metadata.name")] = d
    pods = []
    for name, dep in by_kind.get("Deployment", {}).items():
        where = f"Deployment/{name}"
        sel = _get(dep, "spec.selector.matchLabels") or {}
        labels = _get(dep, "spec.template.metadata.labels") or {}
        if not sel.items() <= labels.items():
            errs.append(f"{where}: selector {sel} does not match template labels {labels}")
        spec = _get(dep, "spec.template.spec") or {}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec.get("containers", []):
            cw = f"{where}/{c.get('name')}"
            for field in ("name", "image", "ports", "readinessProbe", "livenessProbe"):
                if not c.get(field):
                    errs.append(f"{cw}: missing {field}")
            for bound in ("requests", "limits"):
                res = _get(c, f"resources.{bound}") or {}
                if not {"cpu", "memory"} <= set(res):
                    errs.append(f"{cw}: resources.{bound} needs cpu and memory")
            named_ports = {p.get("name") for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe"):
                port = _get(c, f"{probe}.httpGet.port") or _get(c, f"{probe}.tcpSocket.port")
                if isinstance(port, str) and port not in named_ports:
                    errs.append(f"{cw}: {probe} port {port!r} is not a container port")
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes:
                    errs.append(f"{cw}: volumeMount {m['name']!r} has no volume")
        for v in volumes.values():
            if "configMap" in v and v["configMap"]["name"] not in by_kind.get("ConfigMap", {}):
                errs.append(f"{where}: volume {v['name']}: no ConfigMap {v['configMap']['name']}")
            if "secret" in v and v["secret"]["secretName"] not in by_kind.get("Secret", {}):
                errs.append(f"{where}: volume {v['name']}: no Secret {v['secret']['secretName']}")
        pods.append((labels, spec.get("containers", [])))
    for owner in ("Service", "PodDisruptionBudget"):
        for name, obj in by_kind.get(owner, {}).items():
            sel = _get(obj, "spec.selector") if owner == "Service" else None
            sel = sel or _get(obj, "spec.selector.matchLabels") or {}
            matched = [c for labels, c in pods if sel.items() <= labels.items()]
            if not matched:
                errs.append(f"{owner}/{name}: selector {sel} matches no pod template")
            elif owner == "Service":
                ports = {p.get("name") for cs in matched for c in cs for p in c.get("ports", [])}
                for p in obj["spec"]["ports"]:
                    tp = p.get("targetPort")
                    if isinstance(tp, str) and tp not in ports:
                        errs.append(f"Service/{name}: targetPort {tp!r} not a pod port")
    return errs


def test_k8s_manifests_are_valid() -> None:
    docs = load_manifests(DEPLOY / "k8s")
    assert check_manifests(docs) == []
    kinds = [d["kind"] for d in docs]
    routers = [d for d in docs if d["kind"] == "Deployment" and "router" in d["metadata"]["name"]]
    assert len(routers) == 1 and routers[0]["spec"]["replicas"] == 2
    c = routers[0]["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    engines = [d for d in docs if d["kind"] == "Deployment" and "engine" in d["metadata"]["name"]]
    assert len(engines) == 2 and kinds.count("Secret") >= 3
    assert any(d["kind"] == "Deployment" and "redis" in d["metadata"]["name"] for d in docs)


def test_k8s_policy_configmap_is_a_valid_policy_matching_the_cluster() -> None:
    docs = load_manifests(DEPLOY / "k8s")
    cm = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "ramjet-policy"
    )
    cfg = parse_policy(yaml.safe_load(cm["data"]["policy.yaml"]))
    services = {
        f"{d['metadata']['name']}.{d['metadata']['namespace']}.svc.cluster.local:{p['port']}"
        for d in docs
        if d["kind"] == "Service"
        for p in d["spec"]["ports"]
    }
    for e in cfg.engines:
        assert e.url.removeprefix("http://") in services, e.url
    assert cfg.store.kind == "redis"
    assert cfg.store.url.removeprefix("redis://").split("/")[0].split("@")[-1] in services
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    scraped = {
        t
        for job in prom["scrape_configs"]
        for sc in job.get("static_configs", [])
        for t in sc["targets"]
    }
    assert {e.url.removeprefix("http://") for e in cfg.engines} == scraped


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda d: d[0].update(apiVersion="apps/v1beta1"), "apiVersion"),
        (lambda d: d[0]["spec"]["template"]["metadata"]["labels"].clear(), "selector"),
        (lambda d: d[0]["spec"]["template"]["spec"]["containers"][0].pop("resources"), "resources"),
        (lambda d: d[0]["spec"]["template"]["spec"]["volumes"].pop(), "has no volume"),
        (lambda d: d[1]["spec"].update(selector={"app": "nothing"}), "matches no pod"),
    ],
)
def test_k8s_checker_catches_broken_manifests(mutate: Any, expected: str) -> None:
    docs = [d for d in load_manifests(DEPLOY / "k8s") if d["_file"] == "router.yaml"]
    docs += [d for d in load_manifests(DEPLOY / "k8s") if d["kind"] in ("ConfigMap", "Secret")]
    assert check_manifests(docs) == []
    mutate(docs)
    assert any(expected in e for e in check_manifests(docs)), check_manifests(docs)


# -- systemd -----------------------------------------------------------------------------------

UNIT_SECTIONS = {".service": {"Unit", "Service", "Install"}, ".target": {"Unit", "Install"}}


def parse_unit(path: Path) -> configparser.RawConfigParser:
    cp = configparser.RawConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read_string(path.read_text())
    return cp


def test_systemd_units_parse_and_name_what_they_need() -> None:
    units = sorted((DEPLOY / "systemd").glob("*.service")) + sorted(
        (DEPLOY / "systemd").glob("*.target")
    )
    assert {u.name for u in units} >= {"ramjet-router@.service", "ramjet-engine@.service"}
    for u in units:
        cp = parse_unit(u)
        assert set(cp.sections()) == UNIT_SECTIONS[u.suffix], u.name
        assert cp.get("Unit", "Description"), u.name
        if u.suffix == ".service":
            start = cp.get("Service", "ExecStart")
            assert start.startswith("/"), f"{u.name}: ExecStart needs an absolute path"
            assert cp.get("Service", "Restart") == "on-failure"
            assert cp.get("Service", "User").startswith("ramjet-"), u.name
    router = parse_unit(DEPLOY / "systemd" / "ramjet-router@.service")
    assert "ramjet serve --policy" in router.get("Service", "ExecStart")
    assert router.get("Service", "ExecReload") == "/bin/kill -HUP $MAINPID"


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """`systemd-analyze verify` on the units; the install paths they execute do not exist
    here, so they point at stub executables in the copy."""
    tool = _need(SYSTEMD_ANALYZE, "systemd")
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("ramjet", "python"):
        (stubs / name).write_text("#!/bin/sh\n")
        (stubs / name).chmod(0o755)
    names = []
    for u in sorted((DEPLOY / "systemd").iterdir()):
        if u.suffix in UNIT_SECTIONS:
            text = u.read_text().replace("/opt/ramjet/.venv/bin/", f"{stubs}/")
            (tmp_path / u.name).write_text(text)
            names.append(f"./{u.name}")
    r = _run(tool, "verify", "--man=no", *names, cwd=tmp_path)
    assert r.returncode == 0 and not r.stderr.strip(), r.stdout + r.stderr
    (tmp_path / "broken.service").write_text("[Service]\nExecStart=relative/path\n")
    assert _run(tool, "verify", "--man=no", "./broken.service", cwd=tmp_path).returncode != 0


# -- hardening (issue 29) ----------------------------------------------------------------------


def _containers(dep: dict[str, Any]) -> list[dict[str, Any]]:
    spec = _get(dep, "spec.template.spec") or {}
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _deployments(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def check_hardening(docs: list[dict[str, Any]]) -> list[str]:
    """Every pod runs as non-root with a RuntimeDefault seccomp profile; every container
    (init containers too) cannot escalate, has a read-only root filesystem and drops every
    capability; every image is pinned to a version (no `latest`, no bare name)."""
    errs: list[str] = []
    for name, dep in _deployments(docs).items():
        pod = _get(dep, "spec.template.spec.securityContext") or {}
        if pod.get("runAsNonRoot") is not True or not pod.get("runAsUser"):
            errs.append(f"Deployment/{name}: pod must set runAsNonRoot and a non-zero runAsUser")
        if _get(pod, "seccompProfile.type") != "RuntimeDefault":
            errs.append(f"Deployment/{name}: pod seccompProfile must be RuntimeDefault")
        for c in _containers(dep):
            cw = f"Deployment/{name}/{c.get('name')}"
            sc = c.get("securityContext") or {}
            if sc.get("allowPrivilegeEscalation") is not False:
                errs.append(f"{cw}: allowPrivilegeEscalation must be false")
            if sc.get("readOnlyRootFilesystem") is not True:
                errs.append(f"{cw}: readOnlyRootFilesystem must be true")
            if "ALL" not in (_get(sc, "capabilities.drop") or []):
                errs.append(f"{cw}: capabilities.drop must include ALL")
            if sc.get("privileged") or sc.get("runAsUser") == 0:
                errs.append(f"{cw}: privileged or root")
            image = str(c.get("image", ""))
            tag = image.rsplit("/", 1)[-1].partition(":")[2].partition("@")[0]
            if "@sha256:" not in image and (
                not tag or tag == "latest" or not any(ch.isdigit() for ch in tag)
            ):
                errs.append(f"{cw}: image {image!r} is not pinned to a version")
    return errs


def test_k8s_pods_run_hardened_on_pinned_images() -> None:
    docs = load_manifests(DEPLOY / "k8s")
    assert check_hardening(docs) == []
    assert len(_deployments(docs)) == 4  # router, two engines, redis


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda c, p: c.update(image="ghcr.io/example/ramjet:latest"), "not pinned"),
        (lambda c, p: c.update(image="redis"), "not pinned"),
        (lambda c, p: c["securityContext"].update(readOnlyRootFilesystem=False), "readOnlyRoot"),
        (lambda c, p: c["securityContext"]["capabilities"].update(drop=[]), "drop"),
        (
            lambda c, p: c["securityContext"].pop("allowPrivilegeEscalation"),
            "allowPrivilegeEscalation",
        ),
        (lambda c, p: p.pop("runAsNonRoot"), "runAsNonRoot"),
        (lambda c, p: p.pop("seccompProfile"), "seccomp"),
    ],
)
def test_hardening_checker_catches_each_weakness(mutate: Any, expected: str) -> None:
    import copy

    docs = copy.deepcopy(load_manifests(DEPLOY / "k8s"))
    dep = _deployments(docs)["ramjet-redis"]
    spec = dep["spec"]["template"]["spec"]
    mutate(spec["containers"][0], spec["securityContext"])
    errs = check_hardening(docs)
    assert any(expected in e and "ramjet-redis" in e for e in errs), errs


def _router(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _deployments(docs)["ramjet-router"]


def test_k8s_redis_needs_a_password_from_a_secret_and_routers_send_it() -> None:
    docs = load_manifests(DEPLOY / "k8s")
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    redis = _deployments(docs)["ramjet-redis"]["spec"]["template"]["spec"]["containers"][0]
    var = _flag(redis["args"], "--requirepass")
    assert var is not None and var.startswith("$(") and var.endswith(")"), redis["args"]
    env = {e["name"]: e for e in redis["env"]}
    ref = env[var[2:-1]]["valueFrom"]["secretKeyRef"]
    assert ref["name"] in secrets and ref["key"] in secrets[ref["name"]]["stringData"]
    # the routers' policy (a ConfigMap: no secret in it) gets the password put in at start
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    template = cm["data"]["policy.yaml"]
    assert "${REDIS_PASSWORD}" in template and "REPLACE" not in template
    spec = _router(docs)["spec"]["template"]["spec"]
    init = spec["initContainers"][0]
    init_env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in init["env"]}
    assert init_env["REDIS_PASSWORD"] == ref
    assert "${REDIS_PASSWORD}" in " ".join(init["command"])
    rendered = template.replace("${REDIS_PASSWORD}", "0f" * 32)
    cfg = parse_policy(yaml.safe_load(rendered))
    assert cfg.store.url.startswith("redis://:" + "0f" * 32 + "@ramjet-redis.")
    # the router reads the rendered file, from a volume only its pod has
    router = spec["containers"][0]
    assert _flag(router["command"], "--policy") == "/run/ramjet/policy.yaml"
    vols = {v["name"]: v for v in spec["volumes"]}
    mounted = {m["mountPath"]: m["name"] for m in router["volumeMounts"]}
    assert "emptyDir" in vols[mounted["/run/ramjet"]]


def test_k8s_routers_mount_the_redis_shared_secret_their_policy_reads(tmp_path: Path) -> None:
    """The replicas' MAC key for Redis (`store.shared_secret_file`) is a file of a Secret
    mounted read-only into the router pods, and into no other pod; the ConfigMap holds
    only its path. A router given the manifest's placeholder refuses to start."""
    docs = load_manifests(DEPLOY / "k8s")
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    template = cm["data"]["policy.yaml"]
    cfg = parse_policy(yaml.safe_load(template.replace("${REDIS_PASSWORD}", "0f" * 32)))
    path = cfg.store.shared_secret_file
    assert path is not None and cfg.store.shared_secret is None
    spec = _router(docs)["spec"]["template"]["spec"]
    router = spec["containers"][0]
    vols = {v["name"]: v for v in spec["volumes"]}
    mount = next(
        m for m in router["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")
    )
    assert mount.get("readOnly") is True
    secret = vols[mount["name"]]["secret"]
    key = path[len(mount["mountPath"].rstrip("/")) + 1 :]
    assert key in secrets[secret["secretName"]]["stringData"]
    mode = secret.get("defaultMode", 0o644)  # YAML reads 0440 as an octal int
    assert isinstance(mode, int) and mode & 0o007 == 0, oct(mode)  # not world-readable
    # no other pod (Redis, the engines) mounts it
    for name, dep in _deployments(docs).items():
        if name == "ramjet-router":
            continue
        other = [
            v.get("secret", {}).get("secretName")
            for v in dep["spec"]["template"]["spec"]["volumes"]
        ]
        assert secret["secretName"] not in other, name
    placeholder = secrets[secret["secretName"]]["stringData"][key]
    assert placeholder.startswith("REPLACE")
    file = tmp_path / key
    file.write_text(placeholder)
    placed = cfg.store.model_copy(update={"shared_secret_file": str(file)})
    with pytest.raises(ValueError, match="placeholder"):
        placed.secret()
    file.write_text("k" * 32)
    assert placed.model_copy(update={"shared_secret_file": str(file)}).secret() == b"k" * 32


def _selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    sel = _get(policy, "spec.podSelector.matchLabels") or {}
    return bool(sel) and sel.items() <= labels.items()


def test_k8s_network_policies_fence_redis_and_the_ops_port() -> None:
    docs = load_manifests(DEPLOY / "k8s")
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    deps = _deployments(docs)
    router_labels = deps["ramjet-router"]["spec"]["template"]["metadata"]["labels"]
    redis_labels = deps["ramjet-redis"]["spec"]["template"]["metadata"]["labels"]
    on_redis = [p for p in policies if _selects(p, redis_labels)]
    assert on_redis, "no NetworkPolicy selects the Redis pods"
    for p in on_redis:
        assert "Ingress" in p["spec"]["policyTypes"]
        for rule in p["spec"].get("ingress", []):
            froms = rule.get("from") or []
            assert froms, "a rule open to every source"
            for f in froms:
                sel = _get(f, "podSelector.matchLabels") or {}
                assert sel and sel.items() <= router_labels.items() and "namespaceSelector" not in f
    on_router = [p for p in policies if _selects(p, router_labels)]
    assert on_router
    ops_port = int(
        _flag(
            deps["ramjet-router"]["spec"]["template"]["spec"]["containers"][0]["command"],
            "--ops-port",
        )
        or 0
    )
    for p in on_router:
        for rule in p["spec"]["ingress"]:
            ports = {q["port"] for q in rule.get("ports", [])}
            if ops_port in ports:
                assert rule.get("from"), "the ops port is open to everyone"
    for d in deps.values():  # every pod is under some policy
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert any(_selects(p, labels) for p in policies), d["metadata"]["name"]


def test_k8s_metrics_and_admin_are_not_on_the_client_service() -> None:
    docs = load_manifests(DEPLOY / "k8s")
    c = _router(docs)["spec"]["template"]["spec"]["containers"][0]
    port, ops = int(_flag(c["command"], "--port") or 0), int(_flag(c["command"], "--ops-port") or 0)
    assert port and ops and port != ops
    by_name = {p["name"]: p["containerPort"] for p in c["ports"]}
    client = next(
        d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "ramjet-router"
    )
    targets = {by_name.get(p["targetPort"], p["targetPort"]) for p in client["spec"]["ports"]}
    assert targets == {port}, targets
    ops_services = [
        d for d in docs if d["kind"] == "Service"
        and any(by_name.get(p["targetPort"], p["targetPort"]) == ops for p in d["spec"]["ports"])
    ]  # fmt: skip
    assert [d["metadata"]["name"] for d in ops_services] == ["ramjet-router-ops"]
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "ramjet-router")
    sd = job["dns_sd_configs"][0]
    assert sd["port"] == ops and sd["names"][0].startswith("ramjet-router-ops.")
    assert _get(c, "readinessProbe.httpGet.path") == "/readyz"


def test_k8s_router_leaves_the_service_before_it_drains() -> None:
    docs = load_manifests(DEPLOY / "k8s")
    spec = _router(docs)["spec"]["template"]["spec"]
    c = spec["containers"][0]
    cmd = _get(c, "lifecycle.preStop.exec.command") or []
    sleep = _get(c, "lifecycle.preStop.sleep.seconds")
    if sleep is None:
        text = " ".join(cmd)
        assert "sleep" in text, cmd
        sleep = float(text.rsplit("sleep", 1)[1].strip(" ()"))
    assert sleep >= 5
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    drain = parse_policy(yaml.safe_load(cm["data"]["policy.yaml"])).timeouts.drain_s
    assert spec["terminationGracePeriodSeconds"] >= sleep + drain + 10


def test_systemd_routers_and_engines_cannot_read_each_others_secrets() -> None:
    router = parse_unit(DEPLOY / "systemd" / "ramjet-router@.service")
    engine = parse_unit(DEPLOY / "systemd" / "ramjet-engine@.service")
    ru, eu = router.get("Service", "User"), engine.get("Service", "User")
    assert ru != eu and "root" not in (ru, eu)
    assert router.get("Service", "Group") != engine.get("Service", "Group")
    # the engine's private key: root-only on disk, handed to its own unit as a credential
    cred = engine.get("Service", "LoadCredential")
    name, _, path = cred.partition(":")
    assert path.startswith("/etc/ramjet/engine-keys/") and path.endswith("%i.key")
    start = engine.get("Service", "ExecStart")
    assert f"--key %d/{name}" in start and "/etc/ramjet/engine-keys" not in start
    keys_dir = path.rsplit("/", 1)[0]
    assert keys_dir in router.get("Service", "InaccessiblePaths")
    assert "/etc/ramjet/policy.yaml" in engine.get("Service", "InaccessiblePaths")
    assert "/etc/ramjet/redis-secret" in engine.get("Service", "InaccessiblePaths")
    for unit in (router, engine):
        assert unit.get("Service", "NoNewPrivileges") == "yes"
        assert unit.get("Service", "CapabilityBoundingSet") == ""


def test_systemd_router_serves_ops_apart_and_drains_within_its_stop_timeout() -> None:
    router = parse_unit(DEPLOY / "systemd" / "ramjet-router@.service")
    cmd = router.get("Service", "ExecStart").split()
    assert _flag(cmd, "--ops-port") not in (None, _flag(cmd, "--port"))
    delay = float(_flag(cmd, "--shutdown-delay") or 0)
    assert delay > 0
    assert float(router.get("Service", "TimeoutStopSec")) >= delay + 30 + 10
