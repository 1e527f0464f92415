"""The spec benchmark's runs: plain and DSpark alternate prompt by prompt."""

from types import SimpleNamespace

from dspark.bench.spec import _run


class _Engine:
    def __init__(self, name: str, calls: list, length: int):
        self.name, self.calls, self.length = name, calls, length

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append((self.name, prompts[0][0]))
        return [SimpleNamespace(token_ids=list(range(self.length)))]


def test_each_prompt_runs_on_both_engines_before_the_next():
    calls = []
    runs = _run({"plain": _Engine("plain", calls, 3), "dspark": _Engine("dspark", calls, 5)},
                [[10], [20], [30]], params=None)
    assert calls == [("plain", 10), ("dspark", 10), ("plain", 20), ("dspark", 20), ("plain", 30), ("dspark", 30)]
    assert runs["plain"][0] == 9 and runs["dspark"][0] == 15
    assert runs["dspark"][2] == [[0, 1, 2, 3, 4]] * 3 and runs["plain"][1] > 0
