"""Serving: vectors on request over HTTP (``elmo serve``), concurrent requests packed into shared forward passes.

    api       what a client sends and gets: the request models, the output a request asks for, the limits' errors
    compute   the unit a model process runs: one batch of sentences from any requests -> each sentence's answer
    workers   the model processes: started with their share of the cores, watched, restarted when one dies
    batcher   the queue: admits by tokens (429 past it), packs sentences into batches, drops what clients left
    metrics   the Prometheus metrics, present from start-up
    app       the HTTP surface (FastAPI on uvicorn): routes, the body bound, the API key
    run       ``serve(config)``: the port bound first, then the app, SIGTERM drains

The HTTP process never imports torch: the model lives in the worker processes (``compute``), so a worker that
dies takes only its batch with it, and the process that holds the port stays small.
"""
