"""Regenerate the Python stubs of engine.proto: ``python -m m3stack.proto.generate``.

The stubs are committed so that the gateway and operator images need no grpcio-tools;
tests/test_proto.py fails when they are stale.
"""

import logging
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = PROTO_DIR / "engine.proto"
STUB_NAMES = ("engine_pb2.py", "engine_pb2.pyi", "engine_pb2_grpc.py")
# The import path the stubs must use for each other (m3stack/proto/engine_pb2.py).
_PACKAGE_PATH = Path("m3stack", "proto")

logger = logging.getLogger(__name__)


def generate(out_dir: Path) -> list[Path]:
    """Compile engine.proto into ``out_dir`` and return the stub paths."""
    from grpc_tools import protoc  # dev-only dependency

    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / _PACKAGE_PATH
        staged.mkdir(parents=True)
        shutil.copy(PROTO_FILE, staged / PROTO_FILE.name)
        proto_include = str(Path(protoc.__file__).parent / "_proto")
        args = [
            "grpc_tools.protoc",
            f"-I{tmp}",
            f"-I{proto_include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(_PACKAGE_PATH / PROTO_FILE.name),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_FILE}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in STUB_NAMES:
            target = out_dir / name
            shutil.copy(staged / name, target)
            written.append(target)
    return written


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for path in generate(PROTO_DIR):
        logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
