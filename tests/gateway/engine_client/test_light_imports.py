"""The engine client imports without the gateway's media and HTTP stacks: the serving benchmark drives an engine
through it on the GPU machine, which has none of simplejpeg, Pillow, PyAV, FastAPI or httpx (its run on
2026-12-04 stopped at ``import simplejpeg``)."""

import subprocess
import sys
import textwrap

MEDIA_AND_HTTP = ("simplejpeg", "PIL", "av", "fastapi", "starlette", "uvicorn", "httpx")


def test_engine_client_and_serving_benchmark_import_without_media_or_http_packages() -> None:
    script = textwrap.dedent(f"""
        import importlib.abc, sys

        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in {MEDIA_AND_HTTP!r}:
                    raise ImportError(f"{{name}} is not installed here")

        sys.meta_path.insert(0, Refuse())
        import m3stack.gateway.engine_client.client
        import bench.serving.cli
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
