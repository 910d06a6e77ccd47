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
    e2e/install.sh "kind-$CLUSTER" "$PREFIX" "$TAG"
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
