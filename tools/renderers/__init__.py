"""Renderers of ``benchmarks/results/`` for tools/render_numbers.py: ``catalog`` lists the sections in the order of
``benchmarks.toml``, ``generic`` draws those the file describes, ``serving`` the served side-by-side runs and the
README's table, ``page`` lays out the summary and the archive, ``format`` holds the cell formats and the table."""
