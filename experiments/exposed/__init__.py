"""Parts of experiments/bench_exposed.py: the arms it runs (`arms`) and the paired statistics and
tables it reports (`stats`)."""
