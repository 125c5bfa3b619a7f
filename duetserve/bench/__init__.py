"""``duetserve bench``: trace replay against any OpenAI-compatible server, with ``vllm bench
serve``-compatible metrics. Entry points: :mod:`duetserve.bench.cli` (``configure_parser``, ``run``)
and :func:`duetserve.bench.runner.run_benchmark`."""
