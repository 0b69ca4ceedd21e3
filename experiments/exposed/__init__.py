"""Parts of experiments/bench_exposed.py: the arms it builds on each rank (`arms`), the rounds it
times them in inside one process group (`group`) and the paired statistics and tables it reports
(`stats`)."""
