"""sparsync's tools, outside the library: the ``sparsync`` command (``cli``), the benchmarks behind
``sparsync bench ...``, ``demo`` and ``reproduce``, which reproduce the papers' figures on this machine (one
runner, ``runner``; one output module, ``report``), the planner's command (``plan_cli``), and the network
emulation they run on (``netem``: bandwidth-shaped namespaces, root only; ``cluster``: torchrun on emulated
hosts). It imports ``sparsync``; ``sparsync`` never imports it. Needs the ``bench`` extra (rich, matplotlib).
"""
