"""`mlxsched serve` (work in progress): OpenAI request models, stop-string matching, incremental
detokenization, message conversion and event-fed Prometheus metrics. The HTTP app itself is not built yet."""
