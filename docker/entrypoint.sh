#!/bin/sh
# The images' entrypoint: serve the OpenAI-compatible API on $HOST:$PORT (the images set
# 0.0.0.0:8000: every interface of the container, reached through its published port).
# Settings are PAGEDLLAMA_* environment variables (docs/configuration.md); extra arguments go
# to uvicorn. exec: uvicorn replaces the shell, so SIGTERM (docker stop, a pod ending) reaches it.
exec uvicorn server.main:app --host "${HOST:-0.0.0.0}" --port "${PORT:-8000}" --no-access-log "$@"
