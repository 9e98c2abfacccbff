"""`tandem-router`: the OpenAI-compatible HTTP front of a set of Tandem engines.

Torch-free by design (a router pod carries no model stack): it imports only the
tokenizer, the wire protocol, the pure prefix-cache hashing and the sampling
parameters of `tandem_engine`, never the engine, runner or model.

    engines.py      one ZMQ connection per engine: handshake, heartbeats, per-request queues
    routing.py      which engine serves a request: weight version, load, prefix affinity
    dispatch.py     one generation across engines: submit, stream, fail over, cancel
    continuation.py the text of a generation resumed on another engine after a failover
    api_params.py   OpenAI request bodies -> validated generation jobs
    chat.py         chat templates, rendered in a sandbox
    openai_format.py  OpenAI response, chunk, logprobs and error shapes
    metrics.py      Prometheus metrics of the router
    openai_api.py   the FastAPI app
    main.py         the command line and the server's lifecycle
"""
