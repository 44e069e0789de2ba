"""The study: PPOW vs token-level distillation (forward KL and direct-acceptance TV) at equal budget, with
ablations, exact greedy tau and bootstrap intervals over prompts; resumable. See ppow_trl/study/runner.py.

    python benchmarks/study.py                  # the whole study (about 1.5 h on 2 CPU cores; reruns skip
                                                # cached data and finished arms)
    python benchmarks/study.py --report-only    # docs/benchmarks-archive.md's study section from the JSON results
"""

from ppow_trl.study.runner import main

if __name__ == "__main__":
    main()
