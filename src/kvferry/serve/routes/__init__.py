"""The HTTP routes, one module per group; ``serve/app.py`` assembles them.

    openai.py       POST /v1/completions, /v1/chat/completions, /v1/responses;
                    GET and DELETE /v1/responses/{id}
    models.py       GET /v1/models; POST /tokenize, /detokenize
    health.py       GET /health, /version, /metrics
    workers.py      /v1/admin/workers (an admin's)
    ../kv_routes.py /v1/kv/*: public prefixes, per-tenant stats, purges

Each module's ``*_routes(...)`` takes what its handlers use as arguments and
returns Starlette routes. A route reads the caller's authenticated tenant
(``tenants.current_tenant``, set by the auth middleware) once, at the top of
its handler, and passes it on as an argument.
"""
