"""Regenerates the Python stubs of proto/v1/*.proto (run from the repo root).

    python -m pdserve.proto.generate [--out DIR]

The stubs import each other as `pdserve.proto.v1`, the name the package installs under,
so protoc reads the protos through a `pdserve` link to the repository root. CI
regenerates into a temporary folder and checks the committed stubs match.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUBS = ROOT / "proto" / "v1"


def generate(out: Path) -> None:
    """Writes the stubs of every proto in proto/v1 into `out` (a folder)."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto

    with tempfile.TemporaryDirectory() as tmp:
        include, gen = Path(tmp, "include"), Path(tmp, "gen")
        include.mkdir()
        gen.mkdir()
        (include / "pdserve").symlink_to(ROOT, target_is_directory=True)
        protos = [f"pdserve/proto/v1/{p.name}" for p in sorted(STUBS.glob("*.proto"))]
        args = ["protoc", f"-I{include}", f"-I{well_known}", f"--python_out={gen}", f"--pyi_out={gen}",
                f"--grpc_python_out={gen}", *protos]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed: {' '.join(args)}")
        out.mkdir(parents=True, exist_ok=True)
        for stub in (gen / "pdserve" / "proto" / "v1").iterdir():
            shutil.copyfile(stub, out / stub.name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=STUBS)
    generate(ap.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
