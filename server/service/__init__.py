"""The service: the models this process serves and their contexts, the prompt pool, routing
between replicas, and one request's life cycle from prompt to events."""
