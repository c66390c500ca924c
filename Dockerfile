# Kettle's CPU image, laid out as TGI's image is, so a TGI `docker run` line works with this image in its place:
#
#   docker run -p 8080:80 -v $PWD/data:/data kettle --model-id HuggingFaceTB/SmolLM2-135M-Instruct
#
# The HTTP server listens on port 80, the Hugging Face cache (and Kettle's converted models) live in the /data
# volume, and the arguments go to `kettle launch`, which takes every text-generation-launcher flag.
FROM python:3.11-slim

# A C compiler builds Kettle's CPU kernels during the install below, into the image (a container then starts
# without compiling); it stays for sources that differ from the image's. Without one Kettle says so and runs slower.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/kettle
COPY pyproject.toml README.md ./
COPY scripts/ scripts/
COPY kettle/ kettle/
# The same install as `make serve`: scripts/install.sh, runtime only, torch from the CPU wheels (PyPI's Linux
# torch bundles CUDA, gigabytes this image never uses).
RUN PYTHON=python3 EDITABLE=0 TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/install.sh runtime \
    && rm -rf /root/.cache/pip

# TGI's conventions: PORT (read by --port) is 80 and the model caches sit in the /data volume.
ENV PORT=80 \
    HF_HOME=/data \
    HUGGINGFACE_HUB_CACHE=/data \
    KETTLE_CACHE=/data/kettle
VOLUME /data
EXPOSE 80

ENTRYPOINT ["kettle", "launch"]
CMD ["--json-output"]
