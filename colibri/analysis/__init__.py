"""Tools that measure what a model and the machine do: routing statistics and the cache-policy lab (routes.py,
trace.py, routelog.py, cachesim.py), the learned hot set (usage.py), perplexity (perplexity.py), `colibri bench`
(bench.py) and the machine probes the planner reads (probe.py)."""
