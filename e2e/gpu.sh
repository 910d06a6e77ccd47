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
CONTEXT=()
if [[ -n "${KVFLEET_E2E_CONTEXT:-}" ]]; then
    CONTEXT=(--context "$KVFLEET_E2E_CONTEXT")
fi

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
    kubectl "${CONTEXT[@]}" apply -k manifests/
    kubectl "${CONTEXT[@]}" wait --for condition=established --timeout=60s \
        crd/llmdeployments.kvfleet.dev
    kubectl "${CONTEXT[@]}" -n kvfleet-system set image deployment/kvfleet-operator \
        "operator=$PREFIX/operator:$TAG"
    kubectl "${CONTEXT[@]}" -n kvfleet-system set env deployment/kvfleet-operator \
        "KVFLEET_ENGINE_IMAGE=$PREFIX/engine:$TAG" "KVFLEET_GATEWAY_IMAGE=$PREFIX/gateway:$TAG"
    kubectl "${CONTEXT[@]}" -n kvfleet-system rollout status deployment/kvfleet-operator \
        --timeout=180s
}

case "${1:-}" in
    images) images ;;
    install) install ;;
    *)
        echo "usage: KVFLEET_IMAGE_PREFIX=REGISTRY/PATH e2e/gpu.sh images|install" >&2
        exit 2
        ;;
esac
