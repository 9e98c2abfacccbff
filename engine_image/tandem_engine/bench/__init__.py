"""`tandem bench`: a load generator and report for any OpenAI-compatible endpoint.

One module per concern: `workloads` (what to send), `arrivals` (when), `client` (one
streamed request, timed per token), `runner` (a run: workload x arrivals x client, with
the serving-weights timeline), `progress` (a tqdm bar or plain lines), `metrics`
(per-request numbers -> a summary, SLOs and goodput), `report` (console table, the JSON
document) and `schema` (its JSON Schema), `plots` and `html` (figures and a one-page
report), `sweep` (several runs over one arrival parameter), `cli` (the `tandem bench`
flags) and `api` (one call per run, for scripts that start their own stack).
Torch-free: it runs on a laptop against a remote server.
"""
