"""The pure core: graphs, cost and memory models, lower sets, solvers,
schedules and searches. It imports numpy and networkx, never Chainer, so
it can plan for graphs saved elsewhere (``python -c "import
chainer_recompute.core"`` works where Chainer is not installed)."""
