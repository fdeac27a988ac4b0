"""Container images: hadolint-clean, multi-stage, pinned, non-root, labelled, and running the same
`m3stack` subcommands the tests run.  The Dockerfiles are checked here as text and their entrypoints as
processes; `scripts/dev images` builds them (tests/operator/test_images_build.py covers its logic) and the
real-node tests run them."""

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

IMAGES = ("engine", "gateway", "operator")
OCI_LABELS = ("title", "description", "version", "source", "licenses")


def _dockerfile(repo_root: Path, image: str) -> str:
    return (repo_root / "images" / f"{image}.Dockerfile").read_text()


def _hadolint(path: Path) -> subprocess.CompletedProcess:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    return subprocess.run([hadolint, "--no-color", str(path)], capture_output=True, text=True)


@pytest.mark.parametrize("image", IMAGES)
def test_hadolint_is_clean(repo_root, image):
    result = _hadolint(repo_root / "images" / f"{image}.Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_what_it_should(tmp_path):
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\nRUN pip install requests\n")
    result = _hadolint(bad)
    assert result.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3013"):
        assert rule in result.stdout


def _final_stage(text: str) -> str:
    return text[text.rindex("\nFROM ") :]


def _json_instruction(text: str, instruction: str) -> list[str]:
    (line,) = re.findall(rf"^{instruction} (\[.*\])$", _final_stage(text), re.MULTILINE)
    return json.loads(line)


@pytest.mark.parametrize("image", IMAGES)
def test_multi_stage_pinned_non_root_and_labelled(repo_root, image):
    text = _dockerfile(repo_root, image)
    assert len(re.findall(r"^FROM ", text, re.MULTILINE)) >= 2, "multi-stage"
    for default in re.findall(r"^ARG \w+_IMAGE=(\S+)$", text, re.MULTILINE):
        tag = default.rpartition(":")[2]
        assert re.fullmatch(r"\d+\.\d+\.\d+[-\w.]*", tag), f"{default}: pin a full version"
    assert re.search(r"^USER 10001:10001$", _final_stage(text), re.MULTILINE), "runs as the pods' non-root uid"
    for label in OCI_LABELS:
        assert f"org.opencontainers.image.{label}=" in text
    final = _final_stage(text)
    assert "COPY images/constraints.txt /opt/m3stack/share/constraints.txt" in final
    assert "--constraint /opt/m3stack/share/constraints.txt --requirement /opt/m3stack/share/requirements.txt" in final
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11\.", text, re.MULTILINE), "the Debian base's Python (3.11)"
    assert text.count("FROM ${BASE_IMAGE}") == 2, "every stage builds on the base the build argument names"


@pytest.mark.parametrize(
    ("image", "component"), [("engine", "engine"), ("gateway", "gateway"), ("operator", "operator")]
)
def test_entrypoint_runs_the_m3stack_subcommand_the_tests_run(repo_root, image, component):
    text = _dockerfile(repo_root, image)
    assert _json_instruction(text, "ENTRYPOINT") == ["m3stack"]
    command = _json_instruction(text, "CMD")
    assert command[0] == component
    assert f"RUN python3 requirements.py pyproject.toml {component}" in text, "the image installs its component's extra"
    result = subprocess.run(
        [sys.executable, "-m", "m3stack", *command, "--help"],
        capture_output=True,
        text=True,
        cwd=repo_root,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"m3stack {component}" in result.stdout


def _pinned(repo_root: Path) -> dict[str, str]:
    pins = {}
    for line in (repo_root / "images" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not pinned with =="
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_constraints_pin_every_runtime_dependency_within_its_range(repo_root):
    project = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"]]
    for extra in IMAGES:
        requirements += [r for r in project["optional-dependencies"][extra] if not r.startswith("m3stack")]
    pins = _pinned(repo_root)
    regenerate = (
        "regenerate: scripts/dev run python -m pip freeze --exclude-editable | "
        "grep -v -i -E '^(m3stack|torch|torchvision|triton|nvidia-|cuda-)' > images/constraints.txt"
    )
    for text in requirements:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name == "torch":  # the engine image pins the CUDA build itself (TORCH_VERSION)
            assert re.search(r"^ARG TORCH_VERSION=\d", _dockerfile(repo_root, "engine"), re.MULTILINE)
            continue
        assert name in pins, f"{name} is not pinned in images/constraints.txt; {regenerate}"
        assert requirement.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} vs {text}"


def test_the_build_context_keeps_out_what_images_never_copy(repo_root):
    lines = (repo_root / ".dockerignore").read_text().splitlines()
    ignored = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert {".git", "tests", ".whl"} <= ignored
    for image in IMAGES:
        for line in re.findall(r"^COPY (?!--from)(.+)$", _dockerfile(repo_root, image), re.MULTILINE):
            for source in shlex.split(line)[:-1]:
                assert source.split("/")[0] not in ignored, f"{image}: COPY {source} is excluded by .dockerignore"
                assert (repo_root / source).exists(), f"{image}: COPY {source} does not exist"


def _extra(project: dict, extra: str) -> list[str]:
    return [r for r in project["optional-dependencies"][extra] if not r.startswith("m3stack[")]


def test_each_image_installs_the_core_and_its_extra(repo_root, images_script):
    requirements = images_script("requirements")
    project = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]
    for component in IMAGES:
        assert requirements.requirements(project, [component]) == [
            *project["dependencies"],
            *_extra(project, component),
        ]
    engine = requirements.requirements(project, ["engine"], frozenset({"Torch"}))
    assert not any(Requirement(r).name == "torch" for r in engine), "the engine installs torch in its own layer"
    assert "--exclude torch" in _dockerfile(repo_root, "engine")


def test_requirements_follow_the_projects_own_extras(images_script):
    requirements = images_script("requirements")
    project = {
        "dependencies": ["grpcio>=1"],
        "optional-dependencies": {
            "a": ["x>=1", "grpcio>=1"],
            "b": ["y; sys_platform != 'win32'"],
            "all": ["m3stack[a,b]"],
        },
    }
    assert requirements.requirements(project, ["all"]) == ["grpcio>=1", "x>=1", "y; sys_platform != 'win32'"]
    assert requirements.requirements(project, ["all"], frozenset({"X"})) == ["grpcio>=1", "y; sys_platform != 'win32'"]
    with pytest.raises(ValueError, match=r"no such extra in pyproject\.toml: c"):
        requirements.requirements(project, ["c"])


def test_the_requirements_command_prints_one_a_line(repo_root, capsys, images_script):
    requirements = images_script("requirements")
    assert requirements.main([str(repo_root / "pyproject.toml"), "operator"]) == 0
    project = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]
    assert capsys.readouterr().out.splitlines() == [*project["dependencies"], *_extra(project, "operator")]


@pytest.mark.parametrize("image", IMAGES)
def test_every_build_argument_the_build_script_passes_is_declared(repo_root, image, images_script):
    # podman only warns about a --build-arg no ARG takes; a renamed ARG would silently drop the proxy CA or the cache.
    build = images_script("build")
    declared = set(re.findall(r"^ARG (\w+)", _dockerfile(repo_root, image), re.MULTILINE))
    plan = next(p for p in build.plans(repo_root, "0.1.0", "cpu", "base") if p.name == image)
    passed = {"BASE_IMAGE", *plan.build_args, "UV_NO_CACHE", "UV_CACHE_DIR", "PIP_CERT", "SSL_CERT_FILE"}
    assert passed <= declared


def test_the_engine_takes_its_device_from_a_build_argument(repo_root):
    text = _dockerfile(repo_root, "engine")
    assert re.search(r"^ARG DEVICE=cpu$", _final_stage(text), re.MULTILINE)
    # The default --device of the image's `m3stack engine` (the operator also passes --device explicitly).
    assert "M3STACK_ENGINE_DEVICE=${DEVICE}" in text
    assert '"flashinfer-python==${FLASHINFER_VERSION}"' in text


@pytest.mark.parametrize(("image", "command"), [("engine", "init-tiny"), ("gateway", "init-tiny --no-weights")])
def test_engine_and_gateway_images_hold_the_tiny_model_under_one_cache(repo_root, image, command):
    text = _final_stage(_dockerfile(repo_root, image))
    assert "M3STACK_CACHE=/opt/m3stack/cache" in text
    assert re.search(rf"^RUN m3stack model {command}$", text, re.MULTILINE)
