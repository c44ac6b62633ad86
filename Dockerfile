# Multi-stage build of the single `lorry` binary.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --bin lorry

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/lorry /usr/local/bin/lorry
EXPOSE 8080
ENTRYPOINT ["lorry"]
