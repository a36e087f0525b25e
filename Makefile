# The two commands of the README. Both create .venv first (scripts/setup.sh).
.PHONY: setup demo test test-fast test-large reproduce
setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/sparsync demo

# Lint, type-check, then the default test run (multi-process gloo groups included; `large` grids excluded), two
# test files at a time (pytest-xdist; a file's tests stay in one worker, which keeps its fixtures' process pools):
# the serial run kept 0.6 of the 2 cores busy, waiting on process starts and sockets (970 s serial, 690 s so).
test: setup
	.venv/bin/ruff check src tests examples setup.py
	.venv/bin/ruff format --check src tests examples setup.py
	.venv/bin/mypy
	.venv/bin/python -m pytest -q -rfER --durations=15 -n 2 --dist loadfile

# Under a minute: no process groups, no server processes (the tests of single-process code).
test-fast: setup
	.venv/bin/python -m pytest -q -m "not multiprocess and not servers and not slow and not large and not netns"

# The big grids, by hand.
test-large: setup
	.venv/bin/python -m pytest -q -m large

# Each paper's headline result at laptop scale (docs/results_reproduce.md); the LM corpus is Debian's dict-gcide.
reproduce: setup
	@test -f /usr/share/dictd/gcide.dict.dz || apt-get install -y -q dict-gcide >/dev/null
	.venv/bin/sparsync reproduce --quick --net 1gbit --out results/reproduce_quick
