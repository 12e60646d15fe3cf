#!/usr/bin/env bash
# A wheelhouse of autoloop's dependencies other than torch, for a GPU machine without internet.
#
#   On a machine with a package index (same CPU architecture; any OS that pip can target):
#     scripts/wheelhouse.sh build [DIR]       # DIR defaults to ./wheelhouse
#   Copy DIR (and this repository) to the GPU machine, which already has torch, then:
#     scripts/wheelhouse.sh install [DIR]
#
# Options through the environment:
#   EXTRAS=report          extras to include (comma-separated; "report" brings matplotlib,
#                          which `autoloop check` uses for its LR plot); EXTRAS= for none
#   PYTHON_VERSION=3.11    build for another interpreter than this one (e.g. the GPU
#   PLATFORM=manylinux2014_x86_64   machine's), binary wheels only; both unset: this machine's
#   PYTHON=python3         the interpreter to use
# torch is never downloaded: the GPU machine's CUDA build stays as it is. See docs/gpu.md.
set -euo pipefail

cmd="${1:-}"
dir="${2:-wheelhouse}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
extras="${EXTRAS-report}"

requirements() {
  # The [project] dependencies (and the chosen extras) of pyproject.toml, minus torch.
  "$python" - "$repo/pyproject.toml" "$extras" <<'PY'
import re, sys
try:
    import tomllib
except ModuleNotFoundError:
    import tomli as tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = list(project["dependencies"])
for extra in filter(None, sys.argv[2].split(",")):
    reqs += project.get("optional-dependencies", {}).get(extra.strip(), [])
for req in reqs:
    if re.match(r"\s*torch\b", req) is None:
        print(req)
PY
}

case "$cmd" in
  build)
    mkdir -p "$dir"
    requirements > "$dir/requirements.txt"
    target=()
    if [[ -n "${PYTHON_VERSION:-}" || -n "${PLATFORM:-}" ]]; then
      target=(--only-binary=:all:)
      [[ -n "${PYTHON_VERSION:-}" ]] && target+=(--python-version "$PYTHON_VERSION")
      [[ -n "${PLATFORM:-}" ]] && target+=(--platform "$PLATFORM")
    fi
    "$python" -m pip download --dest "$dir" "${target[@]}" -r "$dir/requirements.txt"
    # autoloop itself, and the build backend pip needs to install a source tree offline.
    "$python" -m pip wheel --no-deps --wheel-dir "$dir" "$repo"
    "$python" -m pip download --dest "$dir" "${target[@]}" "setuptools>=77" wheel
    echo "wheelhouse: $(ls "$dir" | wc -l) files in $dir; copy it to the GPU machine and run: scripts/wheelhouse.sh install $dir"
    ;;
  install)
    [[ -d "$dir" ]] || { echo "error: no wheelhouse at $dir: build one with 'scripts/wheelhouse.sh build $dir' on a machine with a package index" >&2; exit 1; }
    "$python" -c "import torch" 2>/dev/null || { echo "error: torch is not importable by $python: install the machine's torch build first (the wheelhouse leaves torch out on purpose)" >&2; exit 1; }
    spec="autoloop-research"
    [[ -n "$extras" ]] && spec="autoloop-research[$extras]"
    "$python" -m pip install --no-index --find-links "$dir" "$spec"
    "$python" -c "import autoloop.cli, torch; print('autoloop installed offline; torch', torch.__version__, '| CUDA', torch.cuda.is_available())"
    ;;
  *)
    echo "usage: scripts/wheelhouse.sh build [DIR] | install [DIR]   (see docs/gpu.md)" >&2
    exit 2
    ;;
esac
