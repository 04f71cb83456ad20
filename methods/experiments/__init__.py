"""Tools across the papers' packages: ``offline_runs`` runs a paper's recorded offline experiments as single-method
jobs (the ``results.jsonl`` its ``tables`` read), and ``offline_twins`` writes the offline twin of every paper config.

    python -m rayfed.methods.experiments.offline_runs --plan fedmosaic --seeds 0 1 2 --out runs/fedmosaic
    python -m rayfed.methods.experiments.offline_twins
"""
