# The two commands of the README. Both create .venv first (scripts/setup.sh).
.PHONY: setup demo test lint bench-large
setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/sparsync demo

# Lint, type-check, then the default test run (multi-process gloo groups included; `large` grids excluded).
test: setup
	.venv/bin/ruff check src tests
	.venv/bin/ruff format --check src tests
	.venv/bin/mypy
	.venv/bin/python -m pytest -q

# The big grids, by hand.
test-large: setup
	.venv/bin/python -m pytest -q -m large
