#!/bin/sh
# The images' entrypoint: serve the OpenAI-compatible API on $HOST:$PORT (defaults 0.0.0.0:8000).
# Settings are PAGEDLLAMA_* environment variables (docs/configuration.md); extra arguments go
# to uvicorn. exec: uvicorn replaces the shell, so SIGTERM (docker stop, a pod ending) reaches it.
exec uvicorn server.main:app --host "${HOST:-0.0.0.0}" --port "${PORT:-8000}" --no-access-log "$@"
