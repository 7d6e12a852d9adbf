#!/usr/bin/env bash
# Build the real control-plane binaries from the Go module proxy, cached by version outside the repo.
#   devcluster/build.sh            -> prints the bin directory on stdout (last line)
# Components: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, jobset controller, kwok,
# JobSet's in-place-restart agent (agent/: a folder of its own, so it can go on a pod's PATH alone),
# the worker's PID 1 in front of it (tpujob-init, from this repository: built every time into
# INIT_DIR, controlplane.IMAGE_BIN_DIR, since its source is not versioned like the others),
# and Kueue (optional in the devcluster, built all the same so a clean clone has everything).
# Versions are pinned here; each folder's key is its versions, so a bump rebuilds into a new folder.
# The bin folder (the one printed) is keyed by Kubernetes, etcd and kwok and holds their binaries.
# JobSet and Kueue have versioned folders of their own (a bump rebuilds only that one), linked from it:
#   jobset-$JOBSET_VERSION/: jobset (the controller), agent/, jobset-crd.yaml and jobset-webhooks.yaml
#   (its CRD and webhook configurations, copied from the module), each linked by that name;
#   kueue-$KUEUE_VERSION/: its manager binary, its CRDs and its webhook configurations, linked as kueue/.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.35.4}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.5}"
JOBSET_VERSION="${JOBSET_VERSION:-v0.12.0}"
KWOK_VERSION="${KWOK_VERSION:-v0.7.0}"
KUEUE_VERSION="${KUEUE_VERSION:-v0.19.0}"
# What a devcluster runs without Kueue (`COMPONENTS=devcluster`, as `make demo` asks); the default adds Kueue.
DEVCLUSTER="etcd kube-apiserver kube-controller-manager kube-scheduler jobset agent init kwok"
COMPONENTS="${COMPONENTS:-$DEVCLUSTER kueue}"
COMPONENTS="${COMPONENTS/devcluster/$DEVCLUSTER}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
INIT_DIR="${INIT_DIR:-$REPO/build/image-bin}"

CACHE_ROOT="${TPUJOB_CACHE:-$HOME/.cache/tpujob}"
KEY="k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}"
BIN="$CACHE_ROOT/bin/$KEY"
SRC="$CACHE_ROOT/src/$KEY"
JOBSET_BIN="$CACHE_ROOT/bin/jobset-${JOBSET_VERSION}"
JOBSET_SRC="$CACHE_ROOT/src/jobset-${JOBSET_VERSION}"
KUEUE_BIN="$CACHE_ROOT/bin/kueue-${KUEUE_VERSION}"
mkdir -p "$BIN" "$SRC" "$JOBSET_BIN" "$JOBSET_SRC"
# Go's own caches live in the same versioned root so CI can keep them between runs.
export GOMODCACHE="${GOMODCACHE:-$CACHE_ROOT/go/mod}"
export GOCACHE="${GOCACHE:-$CACHE_ROOT/go/build}"
export GOFLAGS="-mod=mod"
export CGO_ENABLED=0

BUILD_START=$SECONDS
LOGS="$CACHE_ROOT/logs"
mkdir -p "$LOGS"
log() { echo "[build] $*" >&2; }
# Temporary outputs carry this process's id: two builds at once (pytest-xdist's workers) each rename
# their own whole file into place.
elapsed() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

# Run "$@" with its output (Go's download and compile chatter) in $LOGS/NAME.log; a line every 30 s
# says it is still going, and a failure prints the log's tail.
logged() {
  local name="$1" started=$SECONDS
  shift
  "$@" >"$LOGS/$name.log" 2>&1 &
  local pid=$! next=30
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if ((SECONDS - started >= next)); then
      log "$name: $(elapsed $((SECONDS - started))) so far ($(elapsed $((SECONDS - BUILD_START))) in all)"
      next=$((next + 30))
    fi
  done
  if ! wait "$pid"; then
    log "$name failed; the end of $LOGS/$name.log:"
    tail -n 30 "$LOGS/$name.log" >&2
    return 1
  fi
}

k8s_wrapper() {
  local dir="$SRC/k8s"
  [ -f "$dir/go.sum" ] && return 0
  mkdir -p "$dir"
  local minor="v0.${K8S_VERSION#v1.}"
  # k8s.io/kubernetes replaces its staging modules with local paths; replace each with the
  # published v0.X.Y so the main module can be built from the proxy.
  (cd "$dir" && go mod download -json "k8s.io/kubernetes@${K8S_VERSION}" >/dev/null)
  local gomod="$GOMODCACHE/cache/download/k8s.io/kubernetes/@v/${K8S_VERSION}.mod"
  {
    echo "module tpujob.dev/devcluster/k8s"
    echo "go 1.25"
    echo "require k8s.io/kubernetes ${K8S_VERSION}"
    echo "replace ("
    grep -oE '^\s+k8s.io/[a-z0-9-]+ => ./staging' "$gomod" | awk -v v="$minor" '{print "\t" $1 " => " $1 " " v}'
    echo ")"
  } > "$dir/go.mod"
  cat > "$dir/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
GO
  (cd "$dir" && go mod tidy -e >/dev/null 2>&1 || true; go mod download >/dev/null)
}

etcd_wrapper() {
  local dir="$SRC/etcd"
  [ -f "$dir/go.sum" ] && return 0
  mkdir -p "$dir"
  cat > "$dir/go.mod" <<GOMOD
module tpujob.dev/devcluster/etcd
go 1.25
require go.etcd.io/etcd/server/v3 ${ETCD_VERSION}
GOMOD
  cat > "$dir/main.go" <<'GO'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  (cd "$dir" && go mod tidy >/dev/null)
}

# `go install module@version` asks the proxy for the module's version list (to check deprecation),
# which the proxy refuses for some modules; a one-line wrapper module needs only that exact version.
module_wrapper() {
  local name="$1" module="$2" version="$3" package="$4" dir="$5"
  [ -f "$dir/go.sum" ] && return 0
  mkdir -p "$dir"
  printf 'module tpujob.dev/devcluster/%s\ngo 1.25\nrequire %s %s\n' "$name" "$module" "$version" > "$dir/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "%s"\n' "$package" > "$dir/tools.go"
  (cd "$dir" && go mod tidy >/dev/null)
}

jobset_wrapper() { module_wrapper jobset sigs.k8s.io/jobset "$JOBSET_VERSION" sigs.k8s.io/jobset "$JOBSET_SRC"; }
kwok_wrapper() { module_wrapper kwok sigs.k8s.io/kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok "$SRC/kwok"; }

ldflags_k8s() {
  local pkg="k8s.io/component-base/version"
  local minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
  echo "-s -w -X ${pkg}.gitVersion=${K8S_VERSION} -X ${pkg}.gitMajor=1 -X ${pkg}.gitMinor=${minor} -X ${pkg}.gitTreeState=clean -X ${pkg}/verflag.programName=kubernetes"
}

# Where a component's binary goes: the JobSet controller and its agent (the container's process under
# JobSet's InPlaceRestart) into JobSet's folder, the others into the bin folder.
binary() {
  case "$1" in
    jobset) echo "$JOBSET_BIN/jobset" ;;
    agent) echo "$JOBSET_BIN/agent/in-place-restart-agent" ;;
    *) echo "$BIN/$1" ;;
  esac
}

# The cache before JobSet had a folder of its own keyed Kubernetes, etcd, JobSet and kwok together
# (bin/k8s-V_etcd-V_jobset-V_kwok-V): a control-plane binary of the same versions there is taken over
# (a hard link, or a copy), not built again.
adopt() {
  local name="$1" out="$2" old
  for old in "$CACHE_ROOT/bin/k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_jobset-"*"_kwok-${KWOK_VERSION}/$name"; do
    [ -x "$old" ] || continue
    if { ln -f "$old" "$out.tmp.$$" 2>/dev/null || cp "$old" "$out.tmp.$$"; } && mv "$out.tmp.$$" "$out"; then
      log "took $name over from $(dirname "$old")"
      return 0
    fi
  done
  return 1
}

build_one() {
  local name="$1" out
  out="$(binary "$1")"
  if [ -x "$out" ]; then return 0; fi
  mkdir -p "$(dirname "$out")"
  local start=$SECONDS
  log "building $name"
  case "$name" in
    kube-apiserver|kube-controller-manager|kube-scheduler)
      logged "$name" k8s_wrapper
      logged "$name" go -C "$SRC/k8s" build -trimpath -ldflags "$(ldflags_k8s)" -o "$out.tmp.$$" "k8s.io/kubernetes/cmd/$name" ;;
    etcd)
      logged "$name" etcd_wrapper
      logged "$name" go -C "$SRC/etcd" build -trimpath -ldflags "-s -w" -o "$out.tmp.$$" . ;;
    jobset)
      logged "$name" jobset_wrapper
      logged "$name" go -C "$JOBSET_SRC" build -trimpath -ldflags "-s -w" -o "$out.tmp.$$" sigs.k8s.io/jobset ;;
    agent)
      logged "$name" jobset_wrapper
      logged "$name" go -C "$JOBSET_SRC" build -trimpath -ldflags "-s -w" -o "$out.tmp.$$" sigs.k8s.io/jobset/cmd/in-place-restart-agent ;;
    kwok)
      logged "$name" kwok_wrapper
      logged "$name" go -C "$SRC/kwok" build -trimpath -ldflags "-s -w" -o "$out.tmp.$$" sigs.k8s.io/kwok/cmd/kwok ;;
    *) log "unknown component $name"; return 1 ;;
  esac
  mv "$out.tmp.$$" "$out"
  log "built $name in $(elapsed $((SECONDS - start))) ($(elapsed $((SECONDS - BUILD_START))) in all)"
}

kueue_wrapper() {
  local dir="$CACHE_ROOT/src/kueue-${KUEUE_VERSION}"
  [ -f "$dir/go.sum" ] && return 0
  mkdir -p "$dir"
  printf 'module tpujob.dev/devcluster/kueue\ngo 1.25\nrequire sigs.k8s.io/kueue %s\n' "$KUEUE_VERSION" > "$dir/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "sigs.k8s.io/kueue/cmd/kueue"\n' > "$dir/tools.go"
  (cd "$dir" && go mod tidy >/dev/null)
}

# $BIN/NAME -> TARGET, replaced by one rename (a concurrent build or reader never sees it missing), and
# only when it points elsewhere.
link() {
  local target="$1" path="$BIN/$2"
  [ "$(readlink "$path" 2>/dev/null)" = "$target" ] && return 0
  ln -sfn "$target" "$path.tmp.$$"
  mv -Tf "$path.tmp.$$" "$path"
}

# Kueue's manager (a large build: every integration Kueue ships is linked in), then its CRDs (one
# file) and webhook configurations from the same module version.
build_kueue() {
  local dir="$CACHE_ROOT/src/kueue-${KUEUE_VERSION}"
  mkdir -p "$KUEUE_BIN" "$dir"
  if [ ! -x "$KUEUE_BIN/manager" ]; then
    local start=$SECONDS
    log "building kueue ${KUEUE_VERSION}"
    logged kueue kueue_wrapper
    logged kueue go -C "$dir" build -trimpath \
      -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=${KUEUE_VERSION}" \
      -o "$KUEUE_BIN/manager.tmp.$$" sigs.k8s.io/kueue/cmd/kueue
    mv "$KUEUE_BIN/manager.tmp.$$" "$KUEUE_BIN/manager"
    log "built kueue in $(elapsed $((SECONDS - start))) ($(elapsed $((SECONDS - BUILD_START))) in all)"
  fi
  if [ ! -f "$KUEUE_BIN/crds.yaml" ] || [ ! -f "$KUEUE_BIN/webhooks.yaml" ]; then
    (cd "$dir" && go mod download -json "sigs.k8s.io/kueue@${KUEUE_VERSION}" >/dev/null)
    local config="$GOMODCACHE/sigs.k8s.io/kueue@${KUEUE_VERSION}/config/components"
    for crd in "$config"/crd/bases/*.yaml; do echo "---"; cat "$crd"; done > "$KUEUE_BIN/crds.yaml.tmp.$$"
    mv "$KUEUE_BIN/crds.yaml.tmp.$$" "$KUEUE_BIN/crds.yaml"
    install -m 0644 "$config/webhook/manifests.yaml" "$KUEUE_BIN/webhooks.yaml"
  fi
  link "$KUEUE_BIN" kueue
}

# tpujob-init (trainer_image/init): Go's build cache makes an unchanged source a no-op.
build_init() {
  mkdir -p "$INIT_DIR"
  (cd "$REPO/trainer_image/init" && go build -trimpath -ldflags "-s -w" -o "$INIT_DIR/tpujob-init.tmp.$$" .)
  mv "$INIT_DIR/tpujob-init.tmp.$$" "$INIT_DIR/tpujob-init"
}

# The modules first, all at once (the network, not the cores, is their limit), while nothing compiles.
wrapper() {
  case "$1" in
    k8s) k8s_wrapper ;;
    etcd) etcd_wrapper ;;
    jobset) jobset_wrapper ;;
    kwok) kwok_wrapper ;;
    kueue) kueue_wrapper ;;
  esac
}
missing=()
for c in $COMPONENTS; do
  case "$c" in
    kube-apiserver|kube-controller-manager|kube-scheduler) [ -x "$BIN/$c" ] || adopt "$c" "$BIN/$c" || missing+=(k8s) ;;
    etcd|kwok) [ -x "$BIN/$c" ] || adopt "$c" "$BIN/$c" || missing+=("$c") ;;
    jobset|agent) [ -x "$(binary "$c")" ] || missing+=(jobset) ;;
    kueue) [ -x "$KUEUE_BIN/manager" ] || missing+=(kueue) ;;
  esac
done
if ((${#missing[@]})); then
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  log "downloading the Go modules of ${missing[*]} (once; then cached under $CACHE_ROOT/go)"
  pids=()
  for m in "${missing[@]}"; do
    logged "modules-$m" wrapper "$m" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  log "modules downloaded ($(elapsed $((SECONDS - BUILD_START))) in all)"
fi

for c in $COMPONENTS; do
  case "$c" in
    kueue) build_kueue ;;
    init) build_init ;;
    *) build_one "$c" ;;
  esac
done
# The JobSet CRD and webhook configurations ship in the JobSet module: copy them next to its binaries.
if [ ! -f "$JOBSET_BIN/jobset-crd.yaml" ] || [ ! -f "$JOBSET_BIN/jobset-webhooks.yaml" ]; then
  (cd "$JOBSET_SRC" && go mod download -json "sigs.k8s.io/jobset@${JOBSET_VERSION}" >/dev/null)
  jobset_dir="$GOMODCACHE/sigs.k8s.io/jobset@${JOBSET_VERSION}/config/components"
  install -m 0644 "$jobset_dir/crd/bases/jobset.x-k8s.io_jobsets.yaml" "$JOBSET_BIN/jobset-crd.yaml.tmp.$$"
  mv "$JOBSET_BIN/jobset-crd.yaml.tmp.$$" "$JOBSET_BIN/jobset-crd.yaml"
  install -m 0644 "$jobset_dir/webhook/manifests.yaml" "$JOBSET_BIN/jobset-webhooks.yaml.tmp.$$"
  mv "$JOBSET_BIN/jobset-webhooks.yaml.tmp.$$" "$JOBSET_BIN/jobset-webhooks.yaml"
fi
# JobSet's files in the bin folder, under the names its users know (those built, and its yaml always).
for f in jobset agent jobset-crd.yaml jobset-webhooks.yaml; do
  if [ -e "$JOBSET_BIN/$f" ]; then link "$JOBSET_BIN/$f" "$f"; fi
done
echo "$BIN"
