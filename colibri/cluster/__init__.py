"""colibri past one machine: pipeline stages on Ray (docs/CLUSTER.md).

- cluster/split.py: which node holds which layers (in proportion to their budgets) and a stage's tiers;
- cluster/elsewhere.py: a model skeleton holding only some layers (a stage) or only the ends (the head);
- cluster/stage.py: one stage's layers, weights and KV slots (the Ray actor's body);
- cluster/nodes.py: Ray: join, find the nodes offering `colibri`, start actors, wait with deadlines;
- cluster/head.py: the head's plan and slots, the same calls as engine/decode_plan.py.
Ray is an optional extra (`pip install colibri[cluster]`): nothing here imports it until a cluster is asked for.
"""
