"""Every shipped config validates with the real loaders: configs/*.yaml, configs/examples/*.yaml,
the Kaizen configs and KAIZEN_ variables inside deploy/ (compose file, Kubernetes ConfigMap and
Secret), and the Ray start commands there keep their fixed ports out of the worker port range."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from services.common.config import ConfigError, load_config
from services.explorer.config import ExplorerConfig
from services.trainer.config import TrainerConfig
from tests.helpers import REPO

DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
CONFIG_FILES = sorted([*REPO.glob("configs/*.yaml"), *REPO.glob("configs/examples/*.yaml")])


def _model_for(name: str) -> type:
    """The config model a file belongs to, by its name (``*explorer*``, ``*trainer*``, ``demo``, ``dashboard``)."""
    if "explorer" in name:
        return ExplorerConfig
    if "trainer" in name:
        return TrainerConfig
    if name.startswith("train-"):
        from services.agents.dataset import TrainJobConfig

        return TrainJobConfig
    if name.startswith("dashboard"):
        from services.dashboard.config import DashboardConfig

        return DashboardConfig
    if name.startswith("demo"):
        from services.demo.config import DemoConfig

        return DemoConfig
    raise AssertionError(f"{name}: cannot tell which service this config is for; put explorer or trainer in its name")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _load_all(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _kubernetes_docs() -> list[dict]:
    return [d for p in sorted(KUBERNETES.glob("*.yaml")) for d in _load_all(p)]


def _one(kind: str, name: str | None = None) -> dict:
    found = [d for d in _kubernetes_docs() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''} in deploy/kubernetes, found {len(found)}"
    return found[0]


def _compose_value(value: str) -> str:
    """What compose hands the container when no variable is set: ``${X:-d}`` -> d, ``$$`` -> ``$``."""
    value = re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)
    return value.replace("$$", "$")


def _config_arg(command: list[str] | str) -> str:
    words = shlex.split(command) if isinstance(command, str) else [w for part in command for w in shlex.split(part)]
    return words[words.index("--config") + 1]


# ---------------------------------------------------------------------------- configs/


def test_the_examples_are_there():
    names = {p.name for p in REPO.glob("configs/examples/*.yaml")}
    assert {"postgres-explorer.yaml", "postgres-trainer.yaml", "vllm-explorer.yaml",
            "multi-agent-explorer.yaml", "multi-agent-trainer.yaml"} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=_rel)
def test_config_file_validates(path):
    load_config(_model_for(path.name), path, env={})


@pytest.mark.parametrize("path", [p for p in CONFIG_FILES if p.parent.name == "examples"], ids=_rel)
def test_example_opens_with_its_command(path):
    text = path.read_text()
    assert text.startswith("#"), f"{_rel(path)} must open with a comment saying what it is for"
    model = _model_for(path.name)
    service = "explorer" if model is ExplorerConfig else "trainer" if model is TrainerConfig else "train"
    assert f"kaizen {service} --config {_rel(path)}" in text, f"{_rel(path)} must show the command that runs it"


def test_an_unknown_key_in_an_example_fails(tmp_path):
    # The checks above would catch a typo: the same loader on a copy with one bad key.
    broken = tmp_path / "postgres-explorer.yaml"
    text = (REPO / "configs/examples/postgres-explorer.yaml").read_text()
    broken.write_text(text.replace("buffer:\n", "buffer:\n  pool_size: 8\n", 1))
    with pytest.raises(ConfigError, match="unknown config key 'buffer.pool_size'"):
        load_config(ExplorerConfig, broken, env={})


def test_the_vllm_example_selects_vllm_and_the_multi_agent_pair_agree():
    vllm = load_config(ExplorerConfig, REPO / "configs/examples/vllm-explorer.yaml", env={})
    assert vllm.engine.kind == "vllm"
    explorer = load_config(ExplorerConfig, REPO / "configs/examples/multi-agent-explorer.yaml", env={})
    trainer = load_config(TrainerConfig, REPO / "configs/examples/multi-agent-trainer.yaml", env={})
    served = {*explorer.agents.names, explorer.agents.default}
    assert len(served) > 1 and set(trainer.trainer.agents) <= served
    assert (explorer.buffer.url, explorer.checkpoints.root, explorer.model.path) == (
        trainer.buffer.url, trainer.checkpoints.root, trainer.model.path)


def test_the_postgres_pair_shares_buffer_checkpoints_and_model():
    explorer = load_config(ExplorerConfig, REPO / "configs/examples/postgres-explorer.yaml", env={})
    trainer = load_config(TrainerConfig, REPO / "configs/examples/postgres-trainer.yaml", env={})
    assert explorer.buffer.url.startswith("postgresql+psycopg://")  # psycopg 3 is the installed driver
    assert (explorer.buffer.url, explorer.checkpoints.root, explorer.model.path) == (
        trainer.buffer.url, trainer.checkpoints.root, trainer.model.path)


# ---------------------------------------------------------------------------- deploy/


def test_deploy_yaml_parses():
    for path in [DEPLOY / "docker-compose.yaml", *sorted(KUBERNETES.glob("*.yaml")), DEPLOY / "ray" / "cluster.yaml"]:
        assert _load_all(path), f"{_rel(path)} is empty"


def test_compose_services_load_their_configs_with_their_environment():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "explorer", "trainer"} <= set(services)
    for name, model in [("explorer", ExplorerConfig), ("trainer", TrainerConfig)]:
        svc = services[name]
        env = {k: _compose_value(str(v)) for k, v in svc["environment"].items()}
        config = load_config(model, REPO / _config_arg(svc["command"]), env=env)
        assert config.buffer.url.startswith("postgresql+psycopg://") and "@postgres:" in config.buffer.url
        mounts = {v.split(":")[1] for v in svc["volumes"]}
        assert config.checkpoints.root in mounts, f"{name}: checkpoints.root is not on a shared volume"
    assert "/health" in " ".join(services["explorer"]["healthcheck"]["test"])
    assert services["explorer"]["environment"]["KAIZEN_SERVER__HOST"] == "0.0.0.0"


def test_kubernetes_configmap_configs_validate_with_the_secret(tmp_path):
    data = _one("ConfigMap", "kaizen-config")["data"]
    secret = _one("Secret", "kaizen-secrets")["stringData"]
    deployments = {d["metadata"]["name"]: d for d in _kubernetes_docs() if d["kind"] == "Deployment"}
    assert set(deployments) == {"kaizen-explorer", "kaizen-trainer"}
    for name, deployment in deployments.items():
        spec = deployment["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        key = Path(_config_arg(container["command"])).name
        assert key in data, f"{name} reads {key}, which the ConfigMap lacks"
        env = {}
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = var["value"]
            elif "secretKeyRef" in var.get("valueFrom", {}):
                env[var["name"]] = secret[var["valueFrom"]["secretKeyRef"]["key"]]
        (tmp_path / key).write_text(data[key])
        config = load_config(_model_for(key), tmp_path / key, env=env)
        assert config.buffer.url.startswith("postgresql+psycopg://")
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        claim = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in spec["volumes"]}
        assert claim[mounts[config.checkpoints.root]] == "kaizen-checkpoints"
    assert set(data) == {"explorer.yaml", "trainer.yaml"}


def test_kubernetes_explorer_is_probed_on_health_and_checkpoints_are_shared():
    (container,) = _one("Deployment", "kaizen-explorer")["spec"]["template"]["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    service = _one("Service", "kaizen-explorer")
    assert service["spec"]["ports"][0]["port"] == 8010
    assert _one("PersistentVolumeClaim", "kaizen-checkpoints")["spec"]["accessModes"] == ["ReadWriteMany"]


def _ray_start_commands() -> list[str]:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    texts = [" ".join(s["command"]) for s in compose["services"].values() if isinstance(s.get("command"), list)]
    texts += [" ".join(c["command"]) for d in _kubernetes_docs() if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]]
    cluster = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    texts += cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"]
    return [t for t in texts if "ray start" in t]


def test_ray_nodes_name_their_ip_and_keep_fixed_ports_out_of_the_worker_range():
    commands = _ray_start_commands()
    assert len(commands) >= 4  # compose head and worker, Kubernetes head, cluster head and worker
    for text in commands:
        flags = dict(re.findall(r"--([a-z-]+)=(\S+)", text))
        assert "node-ip-address" in flags, text
        low, high = int(flags.get("min-worker-port", 10002)), int(flags.get("max-worker-port", 19999))
        for port in ("port", "object-manager-port", "node-manager-port", "ray-client-server-port", "dashboard-port"):
            if port in flags:
                assert not low <= int(flags[port]) <= high, f"--{port}={flags[port]} is inside {low}-{high}: {text}"
