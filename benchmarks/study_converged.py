"""The converged study: KD to convergence, then PPOW, on-policy distillation and KD continued from it (see
``ppow_trl.study.converged``). Resumable; results under benchmarks/results/study_converged/.

    python benchmarks/study_converged.py                  # everything (about 100 minutes on 2 cores)
    python benchmarks/study_converged.py --stage converge # the converged drafters only
    python benchmarks/study_converged.py --report-only    # summary.json, plot and docs/benchmarks-archive.md section
"""

from ppow_trl.study.converged import main

if __name__ == "__main__":
    main()
