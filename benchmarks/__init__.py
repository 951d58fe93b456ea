"""The project's benchmark harnesses: the numbers behind docs/benchmarks.md.

Not part of the installed package. Run from a checkout of the repository, after the README's
install: ``python -m benchmarks NAME [options]`` (``--help`` lists them).

- ``release``, ``save``: the package's own diagnostics (``ray-graceful bench release|save``),
  with the studies ``save --tier memory`` (``memory.py``) and ``save --format dcp``
  (``dcp.py``) added;
- ``plan``: the planner at 1,000 - 100,000 ranks (``plan.py``);
- ``overhead``: step time with the plugin idle (``overhead.py``);
- ``recovery``: a Ray Train run preempted mid-way (``recovery.py``), ``--peers`` the race
  against Ray Train's own handling (``race.py``, with ``train_job.py``'s jobs),
  ``--tier memory`` a hand-built group's restart from the memory tier (``memory.py``);
- ``restart``: warm restart against cold (``restart.py``);
- ``fanout``: a real coordinator and thousands of simulated ranks and nodes (``fanout.py``);
  ``replies``: what one reply to a node agent costs in Ray, as objects or packed
  (``replies.py``);
- ``soak``: eviction cycles back to back on one cluster, resources tracked (``soak.py``;
  ``--warm``: warm restarts of one group, ``soak_warm.py``; ``--train``: Ray Train's warm path,
  ``soak_train.py``);
- ``watcher``: one round of the lost-rank watcher in the GCS, per actor and per job
  (``watcher.py``);
- ``host-loss``: a host crashed or cut off, on real hosts (network namespaces, ``hosts.py``):
  the host watch against Ray's own detection, and false alarms under stalls (``host_loss.py``).

Every one shares ``ray_graceful.tools.bench.kit``: the local cluster, the rank-actor base,
the Markdown table, the results file (default ``bench-output/<name>.json``).
"""
