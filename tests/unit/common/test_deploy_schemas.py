"""deploy/'s Kubernetes manifests against the Kubernetes API's own OpenAPI schemas (kubernetes-validate,
strict: a misspelt or misplaced field fails, as `kubectl apply --validate=strict` would), offline.

KubeRay's resources (ray.io/v1) have no schema there: their pod templates are validated as core/v1
PodTemplateSpecs, and the fields around them against the subset of KubeRay's v1 CRD written below
(the keys each level may have, and rayStartParams as a map of strings, which KubeRay requires).
The kustomizations' resources and patch targets must name files and objects that exist."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.helpers import REPO

DEPLOY = REPO / "deploy"
KUBERNETES_VERSION = "1.33.0"
MANIFESTS = sorted(p for d in ("kubernetes", "kuberay") for p in (DEPLOY / d).glob("*.yaml") if p.name != "kustomization.yaml")

# KubeRay v1 (ray.io/v1) CRD, the keys used or commonly set at each level; None: any value
RAY_CLUSTER_SPEC = {"rayVersion", "enableInTreeAutoscaling", "autoscalerOptions", "headGroupSpec", "workerGroupSpecs",
                    "headServiceAnnotations", "suspend", "managedBy", "gcsFaultToleranceOptions"}
HEAD_GROUP = {"rayStartParams", "template", "serviceType", "headService", "enableIngress"}
WORKER_GROUP = {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template", "scaleStrategy",
                "suspend", "numOfHosts", "idleTimeoutSeconds"}
RAY_JOB_SPEC = {"entrypoint", "rayClusterSpec", "clusterSelector", "shutdownAfterJobFinishes", "ttlSecondsAfterFinished",
                "backoffLimit", "submissionMode", "runtimeEnvYAML", "activeDeadlineSeconds", "suspend", "metadata",
                "entrypointNumCpus", "entrypointNumGpus", "entrypointResources", "submitterPodTemplate", "jobId"}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _keys(where: str, value: dict, allowed: set[str]) -> None:
    unknown = set(value) - allowed
    assert not unknown, f"{where}: {sorted(unknown)} not in KubeRay's v1 schema"


def _pod_template(where: str, template: dict) -> None:
    doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": template}
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{where}: {e.message} at {'.'.join(map(str, e.absolute_path))}")


def _ray_cluster_spec(where: str, spec: dict) -> None:
    _keys(where, spec, RAY_CLUSTER_SPEC)
    groups = [(f"{where}.headGroupSpec", spec["headGroupSpec"], HEAD_GROUP)]
    groups += [(f"{where}.workerGroupSpecs[{i}]", g, WORKER_GROUP) for i, g in enumerate(spec.get("workerGroupSpecs", []))]
    for at, group, allowed in groups:
        _keys(at, group, allowed)
        params = group.get("rayStartParams", {})
        assert all(isinstance(v, str) for v in params.values()), f"{at}.rayStartParams: KubeRay takes strings only: {params}"
        _pod_template(f"{at}.template", group["template"])
        if "replicas" in group:
            assert group.get("minReplicas", 0) <= group["replicas"] <= group.get("maxReplicas", group["replicas"]), at


def _kuberay(where: str, doc: dict) -> None:
    assert doc["apiVersion"] == "ray.io/v1", f"{where}: KubeRay's stable API is ray.io/v1"
    if doc["kind"] == "RayCluster":
        _ray_cluster_spec(f"{where}.spec", doc["spec"])
    elif doc["kind"] == "RayJob":
        _keys(f"{where}.spec", doc["spec"], RAY_JOB_SPEC)
        _ray_cluster_spec(f"{where}.spec.rayClusterSpec", doc["spec"]["rayClusterSpec"])
    else:
        pytest.fail(f"{where}: no check for {doc['kind']}")


@pytest.mark.parametrize("path", MANIFESTS, ids=_rel)
def test_every_manifest_validates_against_the_kubernetes_schemas(path):
    docs = _docs(path)
    assert docs, f"{_rel(path)} is empty"
    for i, doc in enumerate(docs):
        where = f"{_rel(path)}[{i}] {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        if doc.get("apiVersion", "").startswith("ray.io/"):
            _kuberay(where, doc)
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where}: {e.message} at {'.'.join(map(str, e.absolute_path))}")


def test_a_misspelt_field_is_caught():
    """The check itself: strict validation refuses what a typo makes (so the test above can fail)."""
    deployment = _docs(DEPLOY / "kubernetes" / "explorer.yaml")[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="resource"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    cluster = _docs(DEPLOY / "kuberay" / "raycluster.yaml")[0]
    cluster["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 4
    with pytest.raises(AssertionError, match="strings only"):
        _kuberay("raycluster", cluster)


@pytest.mark.parametrize("folder", ["kubernetes", "kuberay"])
def test_kustomizations_name_what_exists(folder):
    base = DEPLOY / folder
    (k,) = _docs(base / "kustomization.yaml")
    objects = set()
    for resource in k["resources"]:
        target = (base / resource).resolve()
        assert target.exists(), f"{folder}/kustomization.yaml names {resource}, which does not exist"
        files = [target] if target.is_file() else [p for p in target.glob("*.yaml") if p.name != "kustomization.yaml"]
        objects |= {(d["kind"], d["metadata"]["name"]) for f in files for d in _docs(f)}
    for patch in k.get("patches", []):
        t = patch["target"]
        assert (t["kind"], t["name"]) in objects, f"{folder}: a patch targets {t}, which no resource defines"


def test_the_explorer_tolerates_a_disruption_and_the_kuberay_trainer_fits_its_cluster():
    docs = [d for p in MANIFESTS for d in _docs(p)]
    explorer = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kaizen-explorer")
    pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= explorer["spec"]["template"]["metadata"]["labels"].items()
    assert explorer["spec"]["replicas"] > pdb["spec"]["maxUnavailable"]
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    driver = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kaizen-trainer-driver")
    script = driver["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert f"{cluster['metadata']['name']}-head-svc:6379" in script  # KubeRay's head Service
    (learners,) = cluster["spec"]["workerGroupSpecs"]
    assert f"ray.workers={learners['replicas']}" in script and "ray.placement=STRICT_SPREAD" in script
    assert f"ray.num_cpus_per_worker={learners['rayStartParams']['num-cpus']}" in script
    # KubeRay's default probes need wget and the dashboard agent, which the image lacks: probes of our own
    for group in (cluster["spec"]["headGroupSpec"], learners):
        (container,) = group["template"]["spec"]["containers"]
        assert {"readinessProbe", "livenessProbe"} <= set(container), container["name"]
