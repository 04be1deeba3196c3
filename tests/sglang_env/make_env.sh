#!/usr/bin/env bash
# A CPU-only SGLang 0.5.23 environment for tests/test_sglang_install.py (`make sglang-check`).
#   tests/sglang_env/make_env.sh [DIR]     (default: build/sglang-cpu)
# DIR/venv (~2.6 GB: triton ~1.0 GB, torch ~0.75 GB, sglang ~0.22 GB). Every package is pinned
# and installed with --no-deps, so no CUDA torch or nvidia-* wheel is pulled in. The project is
# installed from a copy (pip install -e would write an egg-info into the checkout). The only
# stand-in is torchvision (tests/sglang_env/stubs, put on PYTHONPATH by the Makefile).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
DIR=${1:-$ROOT/build/sglang-cpu}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
rm -rf "$DIR/venv" "$DIR/proj"
"$PY" -m venv "$DIR/venv"
PIP=("$DIR/venv/bin/pip" install --no-deps --quiet)

# CPU torch first (the local CPU wheel on our machines; elsewhere add
# --index-url https://download.pytorch.org/whl/cpu).
"${PIP[@]}" torch==2.13.0 filelock==4.3.1 fsspec==2026.9.0 Jinja2==3.1.6 MarkupSafe==3.0.4 \
    mpmath==1.3.0 networkx==3.6.1 sympy==1.14.0 typing_extensions==4.16.0
"$DIR/venv/bin/python" -c 'import sys, torch; sys.exit("not a CPU torch: " + torch.__version__) if torch.version.cuda else None'

"${PIP[@]}" sglang==0.5.23
"${PIP[@]}" -r "$HERE/requirements.txt"

mkdir "$DIR/proj"
tar -C "$ROOT" --exclude=__pycache__ -cf - pyproject.toml README.md speculative service | tar -C "$DIR/proj" -xf -
"${PIP[@]}" "$DIR/proj"

PYTHONPATH="$HERE/stubs" "$DIR/venv/bin/python" -c \
    'import sglang, torch, speculative.sglang.worker; print("sglang", sglang.__version__, "torch", torch.__version__)'
du -sh "$DIR/venv"
