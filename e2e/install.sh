#!/usr/bin/env bash
# Install kvfleet (manifests/) into a cluster, with the images PREFIX/{operator,engine,
# engine-cpu,gateway}:TAG, and wait for the operator. Used by kind.sh and gpu.sh.
#   e2e/install.sh CONTEXT PREFIX TAG     (an empty CONTEXT: kubectl's current one)
set -euo pipefail

cd "$(dirname "$0")/.."
if [[ $# -ne 3 ]]; then
    echo "usage: e2e/install.sh CONTEXT PREFIX TAG" >&2
    exit 2
fi
context=()
if [[ -n "$1" ]]; then
    context=(--context "$1")
fi
prefix=$2
tag=$3

echo "==> installing kvfleet (manifests/) with images $prefix/*:$tag"
kubectl "${context[@]}" apply -k manifests/
kubectl "${context[@]}" wait --for condition=established --timeout=60s \
    crd/llmdeployments.kvfleet.dev
kubectl "${context[@]}" -n kvfleet-system set image deployment/kvfleet-operator \
    "operator=$prefix/operator:$tag"
kubectl "${context[@]}" -n kvfleet-system set env deployment/kvfleet-operator \
    "KVFLEET_ENGINE_IMAGE=$prefix/engine:$tag" \
    "KVFLEET_ENGINE_CPU_IMAGE=$prefix/engine-cpu:$tag" \
    "KVFLEET_GATEWAY_IMAGE=$prefix/gateway:$tag"
kubectl "${context[@]}" -n kvfleet-system rollout status deployment/kvfleet-operator \
    --timeout=180s
