# Sourced by the venv builders (maxtext_venv.sh, checkov_venv.sh).
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
