"""Container images: hadolint-clean, multi-stage, pinned, non-root, labelled, and running the same
`m3stack` subcommands the tests run (no container runtime here, so the Dockerfiles are checked as
text and their entrypoints as processes)."""

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
    assert "--constraint images/constraints.txt" in text


@pytest.mark.parametrize(
    ("image", "component"), [("engine", "engine"), ("gateway", "gateway"), ("operator", "operator")]
)
def test_entrypoint_runs_the_m3stack_subcommand_the_tests_run(repo_root, image, component):
    text = _dockerfile(repo_root, image)
    assert _json_instruction(text, "ENTRYPOINT") == ["m3stack"]
    command = _json_instruction(text, "CMD")
    assert command[0] == component
    assert f'".[{component}]"' in text, "the image installs its component's extra"
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
