"""The tools around the plugin: the ``ray-graceful`` command line (``cli.py``, its argument
types in ``arguments.py``), the user's own measurements (``bench/``: release and save, and the
kit the repository's ``benchmarks/`` harnesses share), the demo (``demo.py``) and the planning
dry run (``dry_run.py``)."""
