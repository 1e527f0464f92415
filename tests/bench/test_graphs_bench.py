"""The graphs benchmark's workload: what each batch level decodes."""

from dspark.bench.graphs import BATCH1_PROMPTS, _cases
from dspark.bench.prompts import CHAT, CODE


class _Tokenizer:
    """Encodes text as its length and a kind marker, enough to tell the prompts apart."""

    def apply_chat_template(self, messages):
        return "<chat>" + messages[0]["content"]

    def encode(self, text, add_special_tokens=True):
        return [1 if text.startswith("<chat>") else 2, len(text)]


def test_batch_one_decodes_several_prompts_alone_chat_through_the_template():
    cases = _cases(_Tokenizer(), [1, 16])
    assert [len(b) for b in cases[1]] == [1] * BATCH1_PROMPTS
    kinds = [b[0][0] for b in cases[1]]
    assert kinds == [1, 2, 1, 2]                              # chat (templated), code, chat, code
    assert cases[1][0][0][1] == len("<chat>" + CHAT[0]) and cases[1][1][0][1] == len(CODE[0])
    assert len(cases[16]) == 1 and len(cases[16][0]) == 16
    assert cases[16][0][:BATCH1_PROMPTS] == [b[0] for b in cases[1]]
