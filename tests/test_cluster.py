"""The GPU cluster's install steps (cluster/gpu-cluster.yaml, cluster/Dockerfile) agree with pyproject.toml: a
Python it supports, and, for the editable install without build isolation, the build requirements and torch
installed first (flash-attn's build imports torch; pip then uses the setuptools already there)."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def cluster_setup() -> list[str]:
    return yaml.safe_load((REPO / "cluster/gpu-cluster.yaml").read_text())["setup_commands"]


def dockerfile_steps() -> list[str]:
    """The Dockerfile's RUN commands, split at ``&&`` into one install step each."""
    text = (REPO / "cluster/Dockerfile").read_text().replace("\\\n", " ")
    runs = [line.removeprefix("RUN ") for line in text.splitlines() if line.startswith("RUN ")]
    return [step.strip() for run in runs for step in run.split("&&")]


def python_versions() -> dict[str, str]:
    """Where each install gets its interpreter -> that interpreter's version."""
    venv = [c for c in cluster_setup() if "-m venv" in c]
    assert len(venv) == 1, venv
    cluster = re.search(r"python(\d)\.(\d+) -m venv", venv[0])
    image = re.search(r"^FROM \S+-py(\d)(\d+)\b", (REPO / "cluster/Dockerfile").read_text(), re.MULTILINE)
    assert cluster and image, "the cluster's venv or the image's tag names no Python minor version"
    return {"gpu-cluster.yaml": ".".join(cluster.groups()), "Dockerfile": ".".join(image.groups())}


@pytest.mark.parametrize("where", ["gpu-cluster.yaml", "Dockerfile"])
def test_the_cluster_installs_a_python_the_project_supports(where: str) -> None:
    """The AMI's python3 is 3.10, where asyncio.timeout (the HTTP guard) does not exist: every POST was a 500."""
    assert python_versions()[where] in SpecifierSet(PYPROJECT["project"]["requires-python"])


@pytest.mark.parametrize("steps", [cluster_setup, dockerfile_steps], ids=["gpu-cluster.yaml", "Dockerfile"])
def test_an_install_without_build_isolation_finds_its_build_requirements(steps: Callable[[], list[str]]) -> None:
    """A stock venv's setuptools (59-65) rejects pyproject's license field; the image had no torch."""
    commands = steps()
    editable = [i for i, c in enumerate(commands) if "--no-build-isolation" in c]
    assert editable, "no editable install found"
    before = " ".join(commands[: editable[0]])
    for requirement in PYPROJECT["build-system"]["requires"]:
        assert f'"{requirement}"' in before, f"{requirement} (pyproject's build-system) is not installed first"
    assert re.search(r"pip install[^;]* torch==", before), "flash-attn's build imports torch: install it first"


@pytest.mark.parametrize("steps", [cluster_setup, dockerfile_steps], ids=["gpu-cluster.yaml", "Dockerfile"])
def test_the_cluster_pins_a_torch_the_project_and_transformers_accept(steps: Callable[[], list[str]]) -> None:
    """Transformers 5 treats torch below 2.6 as absent (``is_torch_available``), and Llama-3's RoPE tables then
    fail to build: the GPU installs pinned 2.5.1 while pyproject allowed it."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    (torch_req,) = [r for r in map(Requirement, PYPROJECT["project"]["dependencies"]) if r.name == "torch"]
    assert Version("2.5.1") not in torch_req.specifier and Version("2.6.0") in torch_req.specifier
    pins = [m.group(1) for c in steps() if (m := re.search(r"torch==(\S+)", c))]
    assert pins and all(Version(pin) in torch_req.specifier for pin in pins), pins


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "cluster").glob("*.sh")))
def test_the_cluster_scripts_parse(script: str) -> None:
    import subprocess

    subprocess.run(["bash", "-n", str(REPO / "cluster" / script)], check=True)


def test_the_rayservice_open_port_requires_its_api_key() -> None:
    """Serve listens on the pod IP (0.0.0.0); the key's secret was optional, and without it the API ran open."""
    service = yaml.safe_load((REPO / "cluster/rayservice.yaml").read_text())
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert serve["http_options"]["host"] == "0.0.0.0"
    refs = [
        env["valueFrom"]["secretKeyRef"]
        for group in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        for container in group["template"]["spec"]["containers"]
        for env in container.get("env", [])
        if env["name"] == "SPECSERVE_API_KEY"
    ]
    assert refs and not any(ref.get("optional") for ref in refs)


def test_the_ray_up_cluster_can_add_nodes_and_gives_them_the_token_and_the_key() -> None:
    """The head's setup replaced Ray's own (which installs boto3), so the autoscaler could not import it and no GPU
    node was ever added; and no step put HF_TOKEN (gated Llama weights) or the API key in the nodes' environment."""
    cluster = yaml.safe_load((REPO / "cluster/gpu-cluster.yaml").read_text())
    assert any("boto3" in c and "~/venv/bin/pip install" in c for c in cluster["head_setup_commands"])
    assert cluster["file_mounts"]["~/specserve.env"] == "./cluster/specserve.env"
    for commands in (cluster["head_start_ray_commands"], cluster["worker_start_ray_commands"]):
        (start,) = [c for c in commands if "ray start" in c]
        assert start.index(". ~/specserve.env") < start.index("ray start") and "set -a" in start
    assert "cluster/specserve.env" in (REPO / ".gitignore").read_text().splitlines()  # it holds secrets


def test_neither_cluster_opens_rays_dashboard_to_callers_without_a_token() -> None:
    """Both configs bound Ray's dashboard to every interface without authentication: anyone reaching its port could
    submit a job, which runs code with the nodes' secrets (the API key guards only Serve's port)."""
    cluster = yaml.safe_load((REPO / "cluster/gpu-cluster.yaml").read_text())
    (start,) = [c for c in cluster["head_start_ray_commands"] if "ray start" in c]
    assert "--dashboard-host=127.0.0.1" in start and "0.0.0.0" not in start
    service = yaml.safe_load((REPO / "cluster/rayservice.yaml").read_text())["spec"]["rayClusterConfig"]
    assert service["authOptions"] == {"mode": "token"}
    head = service["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert 10001 not in [port["containerPort"] for port in head["ports"]]  # Ray Client: nothing here uses it


def test_the_readmes_gpu_install_builds_flash_attn_against_the_installed_torch() -> None:
    """flash-attn is a source build that imports torch: pip's isolated build has none, and a stock venv's
    setuptools rejects pyproject's license field."""
    readme = (REPO / "README.md").read_text()
    (install,) = re.findall(r"`(\.venv/bin/pip install [^`]*\.\[gpu\][^`]*)`", readme)
    assert "--no-build-isolation" in install
    before = readme[: readme.index(install)]
    first = re.findall(r"`(\.venv/bin/pip install [^`]*)`", before)[-1]
    for requirement in PYPROJECT["build-system"]["requires"]:
        assert f'"{requirement}"' in first or requirement in first.split(), requirement
    # ... and every other page that says how (docs/benchmarks.md's GPU section said it without, a build that fails)
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "deployments").glob("*.md"))]
    installs = [i for page in pages for i in re.findall(r"pip install [^`\n]*\.\[gpu\][^`\n]*", page.read_text())]
    assert len(installs) >= 2 and all("--no-build-isolation" in i for i in installs), installs


def test_every_node_runs_the_ray_of_the_image_and_the_rayservice() -> None:
    """The ray-up nodes installed whatever Ray pyproject's ``>=`` allowed on the day each started: a node the
    autoscaler added after a newer release was refused by the head (Ray checks every joining node's version)."""
    pins = {m.group(1) for c in cluster_setup() if (m := re.search(r'"ray\[serve\]==(\S+?)"', c))}
    image = re.search(r"^FROM rayproject/ray:(\d+\.\d+\.\d+)-", (REPO / "cluster/Dockerfile").read_text(), re.MULTILINE)
    service = yaml.safe_load((REPO / "cluster/rayservice.yaml").read_text())["spec"]["rayClusterConfig"]["rayVersion"]
    assert image and pins == {image.group(1)} == {service}, (pins, image, service)
    steps = cluster_setup()
    assert min(i for i, c in enumerate(steps) if "ray[serve]==" in c) < min(
        i for i, c in enumerate(steps) if "--no-build-isolation" in c
    )


def test_the_image_build_sends_no_secret_and_no_virtualenv() -> None:
    """The build context is the checkout: cluster/specserve.env (the HF token, the API key) and a 2 GB .venv went
    to the builder with it."""
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert {"cluster/specserve.env", ".venv", ".git", "bench_out"} <= ignored


def test_ray_up_syncs_to_every_node_nothing_the_image_leaves_out() -> None:
    """``ray up`` mounts the checkout on every node: it sent mypy's 125 MB cache, the other caches and a head
    retrained in place (~1.2 GB of features) to the head and each of up to 8 workers."""
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    ignored = {line for line in ignored if line and not line.startswith("#")}
    excluded = yaml.safe_load((REPO / "cluster/gpu-cluster.yaml").read_text())["rsync_exclude"]
    assert ignored <= set(excluded), ignored - set(excluded)


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"STAGES": "suite spce"}, "unknown stage spce"),
        ({"PYTHON": "/nonexistent/python3"}, "PYTHON=/nonexistent/python3: no such interpreter"),
    ],
)
def test_the_gpu_checks_refuse_a_misspelt_stage_or_python_before_running_any(env: dict[str, str], said: str) -> None:
    """A misspelt stage set status 2 after the stages before it ran, and a later failing stage turned it into 1; a
    PYTHON not found was replaced by whatever python3 the PATH had, which may not have specserve."""
    import os
    import subprocess

    script = REPO / "cluster" / "gpu_checks.sh"
    run = subprocess.run(
        ["bash", str(script), "/nonexistent/out"], env=os.environ | env, capture_output=True, text=True, timeout=60
    )
    assert (run.returncode, said in run.stderr) == (2, True), run.stderr


def test_a_rayservice_worker_pod_fits_the_gpu_node_the_configs_are_sized_for() -> None:
    """Pods asked for 8 CPUs and 48 GiB: more than a g5.2xlarge (8 vCPU, 32 GiB) offers pods, so they stayed
    Pending; a pod needs at most a router's CPUs beside a target's."""
    spec = yaml.safe_load((REPO / "cluster/rayservice.yaml").read_text())["spec"]
    (group,) = spec["rayClusterConfig"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    requests = container["resources"]["requests"]
    cpus, memory_gib = float(requests["cpu"]), int(requests["memory"].removesuffix("Gi"))
    assert cpus < 8 and memory_gib < 32
    args = spec["serveConfigV2"]
    app = yaml.safe_load(args)["applications"][0]["args"] if isinstance(args, str) else args["applications"][0]["args"]
    router, target = app["router_resources"]["num_cpus"], app["target_resources"]["num_cpus"]
    assert router + target <= cpus
