"""sparsync's tools, outside the library: the ``sparsync`` command (``cli``), the benchmarks behind
``sparsync bench NAME`` (one module each in ``bench``, each with its ``Benchmark`` entry), ``demo`` and
``reproduce``, which reproduce the papers' figures on this machine (one runner, ``runner``; one output module,
``report``; one place for number formats and markdown tables, ``fmt``), the planner's command (``plan_cli``), and
the network emulation they run on (``netem``: bandwidth-shaped namespaces, root only; ``cluster``: torchrun on
emulated hosts). It imports ``sparsync``; ``sparsync`` never imports it. Needs the ``bench`` extra (rich,
matplotlib).
"""
