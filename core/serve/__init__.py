"""bestiary.core.serve: the OpenAI-compatible HTTP server (`bestiary serve`) on the runtime's asyncio API.

`protocol` (request / response schemas, requests -> SamplingConfig), `chat` (messages -> prompt
ids through the chat template), `metrics` (Prometheus), `generation` (running one HTTP request's
prompts and samples), `app` (the FastAPI app: routes, auth, errors), `web` (the chat page at /,
whose HTML, JS and CSS are the package data in static/).

Needs the `serve` extra (fastapi, uvicorn, prometheus_client). Nothing but cli imports serve.

Layer 6 of the core (docs/architecture.md). May import: format, plugins, sources, kernels, registry,
layers, quant, lora, runtime, convert.
"""
