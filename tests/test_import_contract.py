"""The import contract (.importlinter): layers of engine, gateway, operator and bench, no cycles, the wire contract
reached by the gateway through its engine client only.

Runs the real import-linter through ``scripts/lint-imports``, exactly as a developer does.
"""

import configparser
import subprocess
import textwrap

# The one gateway package that speaks m3stack.proto.
ADAPTER = "engine_client"


def _lint_imports(repo_root, *extra_configs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(repo_root / "scripts" / "lint-imports"), *map(str, extra_configs)],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_tree_keeps_the_import_contract(repo_root):
    result = _lint_imports(repo_root)
    assert result.returncode == 0, result.stdout + result.stderr
    # Every contract was checked, over the components' modules (not an empty graph).
    assert "6 kept, 0 broken" in result.stdout, result.stdout


def test_an_upward_import_breaks_the_contract(repo_root, tmp_path):
    """The same run reports a contract the tree breaks, naming the import: here the kernels' cache store sits
    above the cache tensors it writes, which the real contract forbids the other way round."""
    upside_down = tmp_path / "upside_down.ini"
    upside_down.write_text(
        textwrap.dedent(
            """\
            [importlinter]
            root_packages =
                m3stack
                bench

            [importlinter:contract:upside-down]
            name = kv_cache above msa
            type = layers
            containers = m3stack.engine
            layers =
                kv_cache
                msa
            """
        )
    )
    result = _lint_imports(repo_root, upside_down)
    assert result.returncode != 0
    assert "kv_cache above msa BROKEN" in result.stdout, result.stdout
    assert "m3stack.engine.msa.store -> m3stack.engine.kv_cache.tensors" in result.stdout, result.stdout


def test_the_wire_contract_is_forbidden_to_every_gateway_package_but_the_engine_client(repo_root):
    """The forbidden contract lists its sources one by one: a new gateway package must join the list."""
    config = configparser.ConfigParser()
    config.read(repo_root / ".importlinter")
    sources = set(config["importlinter:contract:gateway-wire"]["source_modules"].split())
    gateway = repo_root / "gateway"
    packages = {path.parent.name for path in gateway.glob("*/__init__.py")}
    modules = {path.stem for path in gateway.glob("*.py")} - {"__init__"}
    expected = {f"m3stack.gateway.{name}" for name in (packages | modules) - {ADAPTER}}
    assert sources == expected
