#!/usr/bin/env bash
# Downloads into .gpu_deps the wheels of the Python packages a lent GPU machine's image lacks (it reaches no
# package index); scripts/gpu-check.sh installs them there. Run here, where pip reaches the index, and carry
# `.gpu_deps` to the device (wheels: ~25 MB, under the 64 MiB a call carries).
# The image (Python 3.12) holds torch, Triton, transformers, tokenizers, safetensors, huggingface_hub, numpy,
# grpcio, protobuf, psutil, typer, tqdm, pytest and more; these are what it lacked when last read (2026-11).
# grpcio and protobuf come too: the generated gRPC stubs need at least the versions that generated them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
rm -rf .gpu_deps && mkdir -p .gpu_deps
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 \
    manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"$PYTHON" -m pip download -q --no-deps -d .gpu_deps --python-version 3.12 --implementation cp \
    --only-binary=:all: "${platforms[@]}" \
    gguf fastapi starlette pydantic pydantic-core annotated-types typing-inspection "uvicorn[standard]" httptools \
    websockets watchfiles python-dotenv "grpcio>=1.85.1" "grpcio-tools>=1.85.1" "protobuf>=7.35.1" \
    googleapis-common-protos opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions \
    opentelemetry-proto opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common \
    opentelemetry-exporter-otlp-common llguidance jsonschema jsonschema-specifications referencing rpds-py openai \
    jiter sniffio httpx2 httpcore2 truststore "typing-extensions>=4.16" text-generation
du -sh .gpu_deps
