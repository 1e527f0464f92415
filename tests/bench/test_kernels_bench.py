"""The kernels benchmark at a tiny size: every operator timed, every figure a positive number."""

import json

from dspark.bench.kernels import Shapes, bench_kernels
from dspark.kernels import fake
from kernel_paths import PATH_MARKS

TINY = Shapes(hidden=64, heads=2, kv_heads=1, head_dim=32, intermediate=96, vocab=256, draft_vocab=128,
              markov_rank=16, gamma=3, context=24, block_size=4, rows=(1, 3))


@PATH_MARKS[False]
def test_every_kernel_is_timed_with_positive_figures(capsys):
    bench_kernels(TINY, repetitions=1, min_seconds=0.001, cold_bytes=1 << 20, stream_megabytes=4)
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert report["bench"] == "kernels" and report["read_bandwidth_gbs"] > 0
    assert set(report["results"]) == {name.split("::")[1] for name in fake.FAKES}
    for op, runs in report["results"].items():
        assert runs, op
        for case, figures in runs.items():
            assert {"us", "gbs", "mb"} <= set(figures), (op, case)
            assert all(isinstance(v, (int, float)) and v > 0 for v in figures.values()), (op, case, figures)
    assert sum(line.startswith(tuple(report["results"])) for line in lines) == \
        sum(len(runs) for runs in report["results"].values())                  # one table row a case
