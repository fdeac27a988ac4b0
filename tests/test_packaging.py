"""Layout and packaging: import paths, no torch in the gateway/operator, no stdlib shadowing."""

import shutil
import subprocess
import sys
import zipfile


def _python(code: str, cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, env=env)


def test_gateway_and_operator_never_import_torch(repo_root):
    code = (
        "import sys, m3stack.gateway, m3stack.operator, m3stack.proto.engine_pb2_grpc, m3stack.cli;"
        "m3stack.cli.build_parser();"
        "import m3stack.gateway.cli, m3stack.operator.cli;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = _python(code, cwd=repo_root)
    assert result.returncode == 0, result.stderr


def test_stdlib_operator_is_not_shadowed_from_the_repo_root(repo_root):
    # -S: no site import, so nothing has imported the stdlib module before ours could shadow it.
    result = subprocess.run(
        [sys.executable, "-S", "-c", "import operator; print(operator.__file__); operator.itemgetter"],
        cwd=repo_root,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert str(repo_root) not in result.stdout


def _copy_sources(repo_root, destination):
    """The files a fresh clone has that packaging reads (uncommitted edits included)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("m3stack", "engine", "gateway", "operator"):
        shutil.copytree(repo_root / folder, destination / folder, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(repo_root / name, destination / name)


def test_editable_install_maps_components_and_keeps_stdlib_operator(repo_root, tmp_path):
    checkout = tmp_path / "checkout"
    _copy_sources(repo_root, checkout)
    prefix = tmp_path / "prefix"
    install = subprocess.run(
        [
            sys.executable,
            "-I",  # the repository root (cwd, PYTHONPATH) may hold a stale m3stack.egg-info
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--prefix",
            str(prefix),
            "-e",
            str(checkout),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr
    (site_packages,) = prefix.glob("lib/python*/site-packages")
    code = (
        f"import site; site.addsitedir({str(site_packages)!r});"
        "import m3stack.engine, m3stack.proto, m3stack.gateway, m3stack.operator.cli, m3stack.cli, operator;"
        "print(m3stack.engine.__file__); print(m3stack.proto.__file__); print(m3stack.operator.cli.__file__);"
        "print(operator.__file__)"
    )
    # -I: ignore PYTHONPATH, so only the editable install can provide m3stack.
    result = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    engine, proto, operator_cli, stdlib_operator = result.stdout.splitlines()
    assert engine == str(checkout / "engine" / "__init__.py")
    assert proto == str(checkout / "m3stack" / "proto" / "__init__.py")
    assert operator_cli == str(checkout / "operator" / "cli.py")
    assert not stdlib_operator.startswith(str(checkout))


def test_wheel_holds_every_component(repo_root, tmp_path):
    # Built from a copy: setuptools writes m3stack.egg-info and build/ beside the sources, and a
    # half-written egg-info in the repository root (on every test's PYTHONPATH) breaks the pip
    # runs of other tests in parallel ("Invalid version: None").
    checkout = tmp_path / "checkout"
    _copy_sources(repo_root, checkout)
    wheels = tmp_path / "wheels"
    result = subprocess.run(
        [
            sys.executable,
            "-I",  # the repository root (cwd, PYTHONPATH) may hold a stale m3stack.egg-info
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(checkout),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = wheels.glob("m3stack-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "m3stack/cli.py",
        "m3stack/proto/engine.proto",
        "m3stack/proto/engine_pb2.py",
        "m3stack/gateway/cli.py",
        "m3stack/operator/cli.py",
    ):
        assert expected in names
    assert not any(name.startswith(("operator/", "engine/", "gateway/")) for name in names)
