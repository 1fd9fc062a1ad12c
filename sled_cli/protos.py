"""Regenerate the committed Python stubs (sled/v1/) from protos/sled/v1/*.proto."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"       # the contract: .proto files only
STUB_ROOT = REPO                   # the stubs land in the sled package: sled/v1/*_pb2*.py


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc (from grpcio-tools) over every .proto under proto_root, writing into out_dir."""
    from grpc_tools import protoc   # optional: the dev extra
    import grpc_tools   # optional: the dev extra

    protos = sorted(str(p.relative_to(proto_root)) for p in proto_root.rglob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in (Path(out_dir) / "sled").rglob("*_pb2*.py*"))


def main() -> None:
    written = generate(STUB_ROOT)
    for path in written:
        print(path.relative_to(REPO))


if __name__ == "__main__":
    sys.exit(main())
