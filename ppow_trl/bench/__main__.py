"""``python -m ppow_trl.bench ...``: the benchmark CLI (``ppow_trl.bench.cli.main``)."""

from .cli import main

if __name__ == "__main__":
    main()
