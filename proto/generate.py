"""Regenerates the Python stubs of proto/pdserve/v1/*.proto (run from the repo root).

    python -m proto.generate [--out DIR]

CI regenerates into a temporary folder and checks the committed stubs match.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTOS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto" / "pdserve" / "v1").glob("*.proto"))


def generate(out: Path) -> None:
    from grpc_tools import protoc

    args = ["protoc", f"-I{ROOT}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *PROTOS]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT)
    generate(ap.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
