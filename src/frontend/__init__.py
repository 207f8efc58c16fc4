"""The scoring-API frontend: rerank (Jina / vLLM / Cohere v2 / TEI), score (SGLang / vLLM),
one-token completions (OpenAI) and /v1/models over HTTP, translated into calls of the
prefillonly Triton model over gRPC streaming. Its own process (FastAPI on uvicorn), started
and supervised by `python -m prefillonly.serving serve` beside Envoy, which routes these paths
to it. Modules, in the order a request meets them:

    routes.py    each API's request and response shapes (schemas.py: the bodies; errors.py: error shapes)
    scoring.py   preset, rendering, bounds, engine call: what every route shares
    presets.py   scoring presets (scoring_presets.json): template -> shared prompt + items, labels
    upstream.py  the Triton gRPC stream (tritonclient.grpc.aio)
    app.py       reads the model repository, loads the tokenizer and presets, builds the app
"""
