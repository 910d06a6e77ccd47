#!/usr/bin/env bash
# A local kind cluster running kvfleet from images built from this checkout.
#
#   e2e/kind.sh up        create the cluster "kvfleet" (kept if it exists)
#   e2e/kind.sh images    build the engine-cpu, gateway and operator images; load them into kind
#   e2e/kind.sh install   apply manifests/ with those images; wait for the operator
#   e2e/kind.sh down      delete the cluster
#   e2e/kind.sh all       up, images, install
set -euo pipefail

cd "$(dirname "$0")/.."
CLUSTER="${KVFLEET_KIND_CLUSTER:-kvfleet}"
TAG="${KVFLEET_IMAGE_TAG:-e2e}"
PREFIX="${KVFLEET_IMAGE_PREFIX:-kvfleet}"
IMAGES=(engine-cpu gateway operator)

need() {
    for tool in "$@"; do
        command -v "$tool" >/dev/null 2>&1 || {
            echo "e2e/kind.sh: '$tool' is not on PATH (needed: $*)" >&2
            exit 2
        }
    done
}

dockerfile_of() {
    case "$1" in
        engine-cpu) echo engine/Dockerfile.cpu ;;
        engine) echo engine/Dockerfile ;;
        *) echo "$1/Dockerfile" ;;
    esac
}

up() {
    need kind kubectl docker
    if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
        echo "==> kind cluster $CLUSTER exists"
    else
        echo "==> creating kind cluster $CLUSTER"
        kind create cluster --name "$CLUSTER" --wait 180s
    fi
    kubectl config use-context "kind-$CLUSTER" >/dev/null
}

images() {
    need kind docker
    for image in "${IMAGES[@]}"; do
        echo "==> building $PREFIX/$image:$TAG"
        docker build -f "$(dockerfile_of "$image")" -t "$PREFIX/$image:$TAG" .
        kind load docker-image --name "$CLUSTER" "$PREFIX/$image:$TAG"
    done
}

install() {
    need kubectl
    local context=(--context "kind-$CLUSTER")
    echo "==> installing kvfleet (manifests/)"
    kubectl "${context[@]}" apply -k manifests/
    kubectl "${context[@]}" wait --for condition=established --timeout=60s \
        crd/llmdeployments.kvfleet.dev
    kubectl "${context[@]}" -n kvfleet-system set image deployment/kvfleet-operator \
        "operator=$PREFIX/operator:$TAG"
    kubectl "${context[@]}" -n kvfleet-system set env deployment/kvfleet-operator \
        "KVFLEET_ENGINE_CPU_IMAGE=$PREFIX/engine-cpu:$TAG" \
        "KVFLEET_ENGINE_IMAGE=$PREFIX/engine:$TAG" \
        "KVFLEET_GATEWAY_IMAGE=$PREFIX/gateway:$TAG"
    kubectl "${context[@]}" -n kvfleet-system rollout status deployment/kvfleet-operator \
        --timeout=180s
}

down() {
    need kind
    kind delete cluster --name "$CLUSTER"
}

case "${1:-}" in
    up) up ;;
    images) images ;;
    install) install ;;
    down) down ;;
    all) up && images && install ;;
    *)
        echo "usage: e2e/kind.sh up|images|install|down|all" >&2
        exit 2
        ;;
esac
