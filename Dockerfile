# shardlm on an NVIDIA GPU: PyTorch, CUDA 12.8 and cuDNN 9 come from the official PyTorch image, shardlm and
# its other dependencies are installed on top. Build and run (see docs/debugging.md):
#   docker build -t shardlm .
#   docker run --rm --gpus all --ipc=host -v "$PWD/runs:/workspace/runs" shardlm train configs/shakespeare_tiny.yaml
# Build arguments:
#   BASE_IMAGE  the PyTorch image (default: torch 2.11, what shardlm's GPU runs are measured on; fp8 needs
#               torch >= 2.10 with torchao 0.17, so an older torch image loses parallel.precision=fp8)
#   EXTRAS      shardlm's optional features installed (default: every one; `gpu,fp8` for a lean image)
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:<tag> --build-arg EXTRAS=gpu,fp8 -t shardlm .
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}
ARG EXTRAS=gpu,fp8,optim,qlora,wandb,mlflow,sweep,lmeval,gen

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependencies first, in their own layer: editing shardlm's code does not reinstall them. The image's torch
# satisfies `torch>=...`, so pip keeps it (no second, multi-GB torch). tomllib: Python >= 3.11, as in every
# PyTorch >= 2.5 image.
COPY pyproject.toml /opt/shardlm/pyproject.toml
RUN python -c "import tomllib, os; p = tomllib.load(open('/opt/shardlm/pyproject.toml', 'rb'))['project']; \
extras = [e for e in os.environ['EXTRAS'].split(',') if e]; \
print('\n'.join(p['dependencies'] + [r for e in extras for r in p['optional-dependencies'][e]]))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY README.md /opt/shardlm/README.md
COPY shardlm /opt/shardlm/shardlm
RUN pip install --no-deps /opt/shardlm \
    && python -c "import shardlm.cli, shardlm.tokenizer"

# A non-root user; /workspace (its WORKDIR) holds the bundled configs and examples, and `runs/` for output
# (mount a host folder there). Token and HF caches live in its home: mount a volume on /home/shardlm/.cache
# to keep them between containers.
# uid 1000 is the first user of most Linux hosts, so files written to a mounted runs/ are the host user's.
RUN useradd --create-home --uid 1000 --user-group --shell /bin/bash shardlm \
    && mkdir -p /workspace/runs /home/shardlm/.cache \
    && chown -R 1000:1000 /workspace /home/shardlm/.cache
COPY --chown=1000:1000 shardlm/configs /workspace/configs
COPY --chown=1000:1000 examples /workspace/examples
USER 1000:1000
WORKDIR /workspace

ENTRYPOINT ["shardlm"]
CMD ["--help"]
