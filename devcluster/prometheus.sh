#!/usr/bin/env bash
# Build Prometheus and promtool (Apache-2.0) from the Go module proxy, cached by version outside the
# repository. Prints the directory holding `prometheus` and `promtool` (last line).
# Prometheus 3.x is published on the proxy as module versions v0.3MM.P (3.16.0 = v0.316.0). The web
# UI's assets are not built in (no Node build): the devcluster uses the HTTP API only.
# About 6 minutes and 1.5 GB of Go caches on 2 cores, once.
set -euo pipefail
PROMETHEUS_VERSION="${PROMETHEUS_VERSION:-3.16.0}"
IFS=. read -r major minor patch <<<"$PROMETHEUS_VERSION"
MODULE_VERSION="v0.$((major * 100 + minor)).$patch"

CACHE_ROOT="${TPUJOB_CACHE:-$HOME/.cache/tpujob}"
DEST="$CACHE_ROOT/bin/prometheus-v$PROMETHEUS_VERSION"
export GOMODCACHE="${GOMODCACHE:-$CACHE_ROOT/go/mod}"
export GOCACHE="${GOCACHE:-$CACHE_ROOT/go/build}"
export GOFLAGS="-mod=mod"
export CGO_ENABLED=0

if [ ! -x "$DEST/prometheus" ] || [ ! -x "$DEST/promtool" ]; then
  src="$CACHE_ROOT/src/prometheus-v$PROMETHEUS_VERSION"
  mkdir -p "$src"
  cat > "$src/go.mod" <<GO
module tpujob.dev/devcluster/prometheus

go 1.26

require github.com/prometheus/prometheus $MODULE_VERSION
GO
  cat > "$src/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
GO
  echo "[prometheus] building prometheus and promtool $PROMETHEUS_VERSION ($MODULE_VERSION)" >&2
  (cd "$src" && go mod tidy && go build -trimpath -o "$src/bin/" \
    github.com/prometheus/prometheus/cmd/prometheus github.com/prometheus/prometheus/cmd/promtool)
  mkdir -p "$DEST"
  install -m 0755 "$src/bin/prometheus" "$src/bin/promtool" "$DEST/"
fi
echo "$DEST"
