"""``duetserve calibrate``: measure a GPU into a hardware profile and check the cost model
against measured iteration latencies (docs/design.md sections 3 and 5; issue 5, part 4).

Modules: ``workload`` (what is measured), ``gpu`` (how, on CUDA), ``profile`` (curves to a
profile JSON), ``runner`` (the procedure), ``report`` (error statistics, tables, plot),
``cli`` (the command; ``python -m duetserve.calibrate`` runs it without the main CLI).
"""
