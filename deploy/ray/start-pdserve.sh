#!/usr/bin/env bash
# Start pdserve on the head of a `ray up` cluster, joining its Ray:
#   ray exec deploy/ray/cluster.yaml --tmux 'bash ~/pdserve-src/deploy/ray/start-pdserve.sh'
# pdserve joins Ray from the head's own address, so it goes into the config.
set -euo pipefail
NODE_IP="$(hostname -I | awk '{print $1}')"
sed "s/__NODE_IP__/${NODE_IP}/" "$(dirname "$0")/pdserve.yaml" > ~/pdserve.yaml
exec pdserve serve --config ~/pdserve.yaml "$@"
