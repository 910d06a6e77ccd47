#!/usr/bin/env bash
# kvfleet on an existing GPU cluster (the current kubectl context, or $KVFLEET_E2E_CONTEXT).
# Images must be in a registry the nodes can pull from:
#
#   KVFLEET_IMAGE_PREFIX=registry.example.com/kvfleet e2e/gpu.sh images   build and push
#   KVFLEET_IMAGE_PREFIX=registry.example.com/kvfleet e2e/gpu.sh install  apply manifests/
set -euo pipefail

cd "$(dirname "$0")/.."
PREFIX="${KVFLEET_IMAGE_PREFIX:?set KVFLEET_IMAGE_PREFIX to a registry the GPU nodes can pull from}"
TAG="${KVFLEET_IMAGE_TAG:-e2e}"

images() {
    command -v docker >/dev/null 2>&1 || { echo "e2e/gpu.sh: docker is not on PATH" >&2; exit 2; }
    docker build -f engine/Dockerfile -t "$PREFIX/engine:$TAG" .
    docker build -f gateway/Dockerfile -t "$PREFIX/gateway:$TAG" .
    docker build -f operator/Dockerfile -t "$PREFIX/operator:$TAG" .
    for image in engine gateway operator; do
        docker push "$PREFIX/$image:$TAG"
    done
}

install() {
    e2e/install.sh "${KVFLEET_E2E_CONTEXT:-}" "$PREFIX" "$TAG"
}

case "${1:-}" in
    images) images ;;
    install) install ;;
    *)
        echo "usage: KVFLEET_IMAGE_PREFIX=REGISTRY/PATH e2e/gpu.sh images|install" >&2
        exit 2
        ;;
esac
