# One image for every chunkq service. TORCH_SPEC picks the torch build: the default pulls the
# CUDA build from PyPI for GPU hosts; use e.g. "torch==2.13.0 --index-url <cpu wheel index>" for CPU.
FROM python:3.11-slim
ARG TORCH_SPEC="torch>=2.4"
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CHUNKQ_STORE=/store
RUN pip install --no-cache-dir ${TORCH_SPEC}
WORKDIR /opt/chunkq
COPY pyproject.toml README.md ./
COPY jobs ./jobs
COPY queue_worker ./queue_worker
COPY supervisor ./supervisor
COPY chunkq ./chunkq
RUN pip install --no-cache-dir '.[bundled-model]'
# uid 1000: what deploy/k8s's pods run as (runAsUser, fsGroup), so a volume they mount is theirs.
RUN useradd --uid 1000 --create-home chunkq && mkdir -p /store && chown chunkq /store
USER chunkq
ENTRYPOINT ["chunkq"]
CMD ["doctor"]
