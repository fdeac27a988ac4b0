"""images/build.py (`scripts/dev images`): what decides a rebuild, the tags, and the manifest other scripts read.

Building needs podman and minutes to gigabytes of downloads, so the real-node tests (tests/k8s) exercise the
images themselves; these tests cover the decisions: an image is rebuilt exactly when a file it copies, its
Dockerfile, its build arguments or its base change, and ``--print-manifest`` answers only for a current set."""

import json
from pathlib import Path

import pytest

DOCKERFILE = """\
FROM ${BASE_IMAGE} AS build
COPY pyproject.toml app/ ./
COPY --from=build /wheels /wheels
FROM ${BASE_IMAGE}
COPY --chmod=644 data.txt /data.txt
"""


@pytest.fixture
def build(images_script):
    return images_script("build")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A build context shaped like the repository: one Dockerfile per image, the files they copy, and others."""
    for name in ("engine", "gateway", "operator"):
        (tmp_path / "images").mkdir(exist_ok=True)
        (tmp_path / "images" / f"{name}.Dockerfile").write_text(DOCKERFILE)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "m3stack"\nversion = "0.1.0"\n')
    (tmp_path / "app" / "pkg").mkdir(parents=True)
    (tmp_path / "app" / "pkg" / "module.py").write_text("VALUE = 1\n")
    (tmp_path / "data.txt").write_text("data\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_app.py").write_text("def test(): pass\n")
    return tmp_path


def _hash(build, tree: Path, args: dict[str, str] | None = None, base: str = "base-1") -> str:
    return build.inputs_hash(tree, "engine", args or {"VERSION": "0.1.0"}, base)


def test_copied_sources_are_the_context_paths_of_copy_lines(build):
    assert build.copied_sources(DOCKERFILE) == ["pyproject.toml", "app/", "data.txt"]


def test_the_real_dockerfiles_copy_only_what_exists(build, repo_root):
    for name in build.IMAGES:
        sources = build.copied_sources((repo_root / "images" / f"{name}.Dockerfile").read_text())
        files = list(build.context_files(repo_root, sources))
        assert Path("images/constraints.txt") in files and Path("engine/cli.py") in files
        assert not any(part == "tests" for path in files for part in path.parts)


def test_a_change_to_a_copied_file_rebuilds(build, tree):
    before = _hash(build, tree)
    assert _hash(build, tree) == before, "the hash is a pure function of the inputs"
    (tree / "app" / "pkg" / "module.py").write_text("VALUE = 2\n")
    assert _hash(build, tree) != before


def test_a_new_file_in_a_copied_folder_rebuilds(build, tree):
    before = _hash(build, tree)
    (tree / "app" / "pkg" / "extra.jinja").write_text("{{ x }}\n")
    assert _hash(build, tree) != before


def test_files_the_image_never_holds_do_not_rebuild(build, tree):
    before = _hash(build, tree)
    (tree / "tests" / "test_app.py").write_text("def test(): assert True\n")
    (tree / "app" / "pkg" / "__pycache__").mkdir()
    (tree / "app" / "pkg" / "__pycache__" / "module.cpython-311.pyc").write_bytes(b"\0")
    (tree / "app" / "pkg" / "stale.pyc").write_bytes(b"\0")
    assert _hash(build, tree) == before


def test_the_dockerfile_arguments_and_base_rebuild(build, tree):
    before = _hash(build, tree)
    assert _hash(build, tree, {"VERSION": "0.1.0", "DEVICE": "cuda"}) != before
    assert _hash(build, tree, base="base-2") != before
    (tree / "images" / "engine.Dockerfile").write_text(DOCKERFILE + "USER 10001:10001\n")
    assert _hash(build, tree) != before


def test_a_missing_copy_source_is_named(build, tree):
    (tree / "data.txt").unlink()
    with pytest.raises(build.BuildError, match=r"COPY data\.txt: no such file"):
        _hash(build, tree)


def test_tags_name_the_version_and_the_inputs(build, tree):
    cpu = {plan.name: plan for plan in build.plans(tree, "0.1.0", "cpu", "base-1")}
    assert set(cpu) == {"engine", "gateway", "operator"}
    engine = cpu["engine"]
    assert engine.reference == f"localhost/m3stack/engine:0.1.0-{engine.inputs}"
    assert engine.tags == ["localhost/m3stack/engine:0.1.0", engine.reference]
    assert engine.build_args == {"VERSION": "0.1.0", "DEVICE": "cpu"}
    assert cpu["gateway"].build_args == {"VERSION": "0.1.0"}
    cuda = {plan.name: plan for plan in build.plans(tree, "0.1.0", "cuda", "base-1")}
    assert cuda["engine"].tags[0] == "localhost/m3stack/engine:0.1.0-cuda", "the GPU engine never takes the CPU tag"
    assert cuda["engine"].inputs != engine.inputs
    assert cuda["gateway"] == cpu["gateway"]


def _write_manifest(build, paths, plans, tmp_path: Path) -> None:
    paths.output.mkdir(parents=True)
    images = {}
    for plan in plans:
        plan.archive(paths).write_bytes(b"tar")
        images[plan.name] = build.manifest_entry(plan, paths, "cpu", 3, 1.0)
    paths.manifest.write_text(json.dumps({"format": 1, "version": "0.1.0", "images": images}))


def test_the_manifest_is_current_only_for_the_same_inputs_with_their_archives(build, tree, tmp_path):
    paths = build.Paths(tmp_path / "cache")
    plans = build.plans(tree, "0.1.0", "cpu", "base-1")
    assert build.current_manifest(paths, plans) is None, "no manifest yet"
    _write_manifest(build, paths, plans, tmp_path)
    assert build.current_manifest(paths, plans) == paths.manifest
    entry = json.loads(paths.manifest.read_text())["images"]["engine"]
    assert entry["archive"] == str(paths.output / f"engine-{plans[0].inputs}.tar")
    assert entry["tags"] == plans[0].tags and entry["device"] == "cpu"
    (tree / "app" / "pkg" / "module.py").write_text("VALUE = 3\n")
    assert build.current_manifest(paths, build.plans(tree, "0.1.0", "cpu", "base-1")) is None, "a source changed"
    plans[1].archive(paths).unlink()
    assert build.current_manifest(paths, plans) is None, "an archive is gone"


def test_print_manifest_builds_nothing_and_exits_1_when_not_current(build, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("M3STACK_CACHE", str(tmp_path))
    assert build.main(["--print-manifest"]) == 1
    assert capsys.readouterr().out == ""
    assert not (tmp_path / "images").exists(), "it made nothing"


def test_print_manifest_prints_the_path_of_a_current_manifest(build, repo_root, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("M3STACK_CACHE", str(tmp_path))
    paths = build.Paths(tmp_path)
    base = paths.base_dir(build.base_key())
    base.mkdir(parents=True)
    (base / "rootfs.sha256").write_text("0" * 64 + "\n")
    _write_manifest(build, paths, build.plans(repo_root, build.project_version(), "cpu", "0" * 64), tmp_path)
    assert build.main(["--print-manifest"]) == 0
    assert capsys.readouterr().out == f"{paths.manifest}\n"
    assert build.main(["--print-manifest", "--device", "cuda"]) == 1, "the manifest lists the CPU engine"
