"""The benchmark suite behind ``loopgate bench``: the data path against raw baselines.

Every figure is compared with a baseline measured in the same run, on the same CPU
placement, and reported as the median of several repeats::

    loopgate bench                         # everything (a few minutes on 2 cores)
    loopgate bench --quick --json b.json   # the CI smoke run (well under a minute)
    loopgate bench --only gateway.rtt      # just the per-step round trip

Suites are listed in :data:`benchmarks.suites.SUITES`; each is a module with
``run(quick, repeats) -> list[Record]`` (see :mod:`benchmarks.records`).
"""
