"""The wire models of the root service's REST API, one module per surface: `public` (operators, the CLI,
the pages: /api/v1/jobs...), `worker` (a job's agents: /api/v1/worker/jobs/{job}...) and `shared` (the
field types and the models both carry).

The root validates requests and documents its routes with these very models (services.root.schemas
re-exports them), and `worker_lib.client.RootClient` returns them, so the agent, the CLI and the service
agree on one definition. pydantic only: no torch, no services (the training-side package ships it).
"""
