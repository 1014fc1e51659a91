"""bestiary.core.serve: the OpenAI-compatible HTTP server (`bestiary serve`) on the runtime's asyncio API.

`protocol` (request / response schemas, requests -> SamplingConfig), `metrics` (Prometheus),
`generation` (running one HTTP request's prompts and samples), `app` (assembles the FastAPI app:
auth, the routers), `settings` (ServeSettings), `errors` (OpenAI's error shape and the handlers),
and one module per resource's routes: `health` (/health, /metrics), `model_list` (/v1/models),
`completions` (/v1/completions, /v1/chat/completions), `web` (the chat page at /, whose HTML,
JS and CSS are the package data in static/). `process` runs the server in a subprocess.

Needs the `serve` extra (fastapi, uvicorn, prometheus_client). Nothing but cli imports serve.

Layer 6 of the core (docs/architecture.md). May import: format, plugins, sources, kernels, registry,
layers, quant, lora, runtime, convert.
"""
