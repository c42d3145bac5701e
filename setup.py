"""Generate the gRPC wire code from proto/ whenever the package is built.

The .proto file is the single source of truth; ``edge_sdk/_wire/coveil_pb2*.py``
are build outputs (git-ignored), made by grpcio-tools for both regular and
editable installs.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO = ROOT / "proto" / "coveil.proto"
WIRE = "edge_sdk/_wire"


def generate_wire_code() -> None:
    from grpc_tools import protoc  # build requirement (pyproject.toml)

    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{WIRE}={PROTO.parent}",
        f"-I{include}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        str(PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")


class BuildPyWithProto(build_py):
    def run(self) -> None:
        generate_wire_code()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProto})
