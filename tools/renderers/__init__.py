"""Renderers of ``benchmarks/results/`` for tools/render_numbers.py: ``benchmarks.toml`` lists every benchmark the
pages show, ``generic`` draws those it describes, ``serving`` the served side-by-side runs and the README's table,
``catalog`` the few others and the page order, ``page`` lays out the summary and the archive, ``format`` holds the cell
formats and the one table helper."""

from .catalog import sections  # noqa: F401
