# The image configs/kubernetes/tfjob.yaml runs: tfdist from this repository, on CPU.
#
#   docker build -t localhost:5000/tfdist:latest .                       # from the repo root
#   docker build --build-arg HOROVOD=1 -t localhost:5000/tfdist:horovod .  # + Horovod (Gloo)
#   docker push localhost:5000/tfdist:latest
#
# See docs/multi_host.md ("Kubernetes (TFJob)"). Every container runs `tfdist train
# CONFIG --set cluster.mode="env"`; the training operator sets TF_CONFIG.
FROM python:3.11-slim

# 1: also build Horovod 0.28.1 with Gloo (scripts/install_horovod.sh; about 4 minutes).
ARG HOROVOD=0

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TF_CPP_MIN_LOG_LEVEL=2

RUN python -m venv "$VIRTUAL_ENV" && pip install --upgrade pip setuptools wheel

WORKDIR /opt/tfdist
# The package and its configs (.dockerignore keeps .venv, runs and .git out).
COPY pyproject.toml setup.cfg README.md ./
COPY tfdist ./tfdist
COPY configs ./configs
COPY scripts ./scripts
RUN pip install .

# Horovod compiles against the installed TensorFlow; the compilers are removed again.
RUN if [ "$HOROVOD" = "1" ]; then \
        apt-get update && apt-get install -y --no-install-recommends g++ make && \
        bash scripts/install_horovod.sh "$VIRTUAL_ENV/bin/python" && \
        apt-get purge -y g++ make && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*; \
    fi

# Not root: the job needs no privileges. /config and /output are mounted by the TFJob.
RUN useradd --create-home --uid 1000 tfdist
USER tfdist
WORKDIR /home/tfdist
EXPOSE 2222
ENTRYPOINT []
CMD ["tfdist", "train", "--help"]
