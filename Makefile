# `make docs`: the documentation site, built strictly (a warning fails the build), executing the
# tutorials. Output: docs/_build/html/index.html. Needs the docs extra: pip install -e ".[docs]".
PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
SPHINXOPTS ?=

.PHONY: docs docs-clean

docs:
	$(PYTHON) -m sphinx -b html -W --keep-going -j auto $(SPHINXOPTS) docs docs/_build/html

docs-clean:
	rm -rf docs/_build docs/gallery docs/api/generated
