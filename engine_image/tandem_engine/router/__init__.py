"""`tandem-router`: the OpenAI-compatible HTTP front of a set of Tandem engines.

Torch-free by design (a router pod carries no model stack): it imports only the
tokenizer, the wire protocol, the pure prefix-cache hashing and the sampling
parameters of `tandem_engine`, never the engine, runner or model.

    engines.py      one ZMQ connection per engine: handshake, heartbeats, per-request queues
    discovery.py    the engine pool from Kubernetes endpoints, kept current while it runs
    routing.py      pure routing rules: serving weight version, load, prefix affinity
    picker.py       the routing state: which engine or prefill/decode pair, prefix indexes
    attempts.py     one submission to one engine, streamed: Deltas, then its outcome
    dispatch.py     one choice across engines: failover, handoff to decode, deadlines
    param_table.py  the one table of request parameters: name, type, bounds, status,
                    SamplingParams field (validation and the OpenAPI schema derive from it)
    request_errors.py  InvalidRequest, the refusal every parser raises
    api_params.py   OpenAI request bodies -> validated generation jobs (SamplingParams)
    tokenize_params.py  vLLM's /tokenize and /detokenize bodies
    openapi_schema.py  the OpenAPI description, its request bodies from the table
    chat.py         chat templates, rendered in a sandbox
    openai_format.py  OpenAI response, chunk, logprobs and error shapes; the renderer
    metrics.py      Prometheus metrics of the router
    openai_api.py   the HTTP handlers and the FastAPI app
    main.py         the command line and the server's lifecycle
"""
