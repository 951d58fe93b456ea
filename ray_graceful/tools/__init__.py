"""The tools around the plugin: the ``ray-graceful`` command line (``cli.py``), the benchmarks
(``bench.py``, ``bench_fanout.py``), the demo (``demo.py``) and the planning dry run
(``dry_run.py``)."""
