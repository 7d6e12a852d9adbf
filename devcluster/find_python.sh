# Sourced by the venv builders (maxtext_venv.sh, checkov_venv.sh); they define log() first.
# find_python VERSION [OVERRIDE]: print an interpreter of Python VERSION (e.g. 3.12): OVERRIDE if
# given, else pythonVERSION on PATH, else pyenv's install; fails when none runs as that version.
find_python() {
  local version="$1" override="${2:-}" candidate
  for candidate in "$override" "python${version}" "$HOME"/.pyenv/versions/"${version}"*/bin/python"${version}"; do
    [ -n "$candidate" ] || continue
    # pyenv's shim exists even where its version is not the selected one: ask it to run.
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == tuple(map(int, sys.argv[1].split(".")))' \
      "$version" 2>/dev/null; then
      command -v "$candidate" || echo "$candidate"
      return 0
    fi
  done
  echo "no Python ${version} found" >&2
  return 1
}

# cached_venv VENV LINK VERSION OVERRIDE INSTALL: unless VENV is complete, build it afresh with Python
# VERSION (find_python VERSION OVERRIDE) and fill it with INSTALL (a function, $VENV set); then point
# LINK at it (atomically: a reader sees the old venv or the new one).
cached_venv() {
  local link="$2" version="$3" override="$4" install="$5" start python
  VENV="$1"
  if [ ! -f "$VENV/.complete" ]; then
    start=$SECONDS
    rm -rf "$VENV"
    python="$(find_python "$version" "$override")"
    log "building $VENV with $python"
    "$python" -m venv "$VENV"
    "$install"
    touch "$VENV/.complete"
    log "built in $((SECONDS - start))s ($(du -sh "$VENV" | cut -f1))"
  fi
  if [ "$(readlink "$link" 2>/dev/null)" != "$VENV" ]; then
    ln -sfn "$VENV" "$link.tmp" && mv -T "$link.tmp" "$link"
  fi
}
