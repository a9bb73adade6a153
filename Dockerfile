# memproxy: one container beside your app. Same install steps as `make install` (venv + constraints).
# Build: docker build -t memproxy .
# Run:   docker run -p 8080:8080 -v memproxy-data:/data -e MEMPROXY_UPSTREAM__BASE_URL=... memproxy
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    LITELLM_LOCAL_MODEL_COST_MAP=True \
    MEMPROXY_SERVER__HOST=0.0.0.0 \
    MEMPROXY_SERVER__PORT=8080 \
    MEMPROXY_STORAGE__PATH=/data \
    ARROW_DEFAULT_MEMORY_POOL=system \
    MALLOC_MMAP_THRESHOLD_=131072 \
    MALLOC_ARENA_MAX=2

RUN groupadd --system --gid 10001 memproxy \
    && useradd --system --uid 10001 --gid 10001 --home-dir /app --shell /usr/sbin/nologin memproxy \
    && mkdir -p /data /app \
    && chown memproxy:memproxy /data /app

WORKDIR /app
COPY --chown=memproxy:memproxy pyproject.toml constraints.txt README.md ./
COPY --chown=memproxy:memproxy proxy ./proxy
COPY --chown=memproxy:memproxy insights ./insights
COPY --chown=memproxy:memproxy config ./config
COPY --chown=memproxy:memproxy models ./models

USER 10001:10001
RUN python -m venv /app/.venv \
    && /app/.venv/bin/python -m pip install --quiet --upgrade pip \
    && /app/.venv/bin/python -m pip install --quiet -c constraints.txt -e .

VOLUME ["/data"]
EXPOSE 8080
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["/app/.venv/bin/python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]

# memproxy serve: a supervisor, one chat process per core (MEMPROXY_SERVER__WORKERS) and a memory writer
# (docs/operations.md, "Processes"); the allocator settings above: docs/operations.md, "Memory (RSS)".
# SIGTERM starts a graceful shutdown (in-flight streams finish, queued memory jobs are kept on disk).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/app/.venv/bin/memproxy", "serve"]
