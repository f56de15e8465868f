"""`specgraph serve DIR`: a directory written by `specgraph compile` served as it is.

Its settings come from its manifest (a flag asking for another value exits 2 before anything
loads); its round packages serve every round and the directory's own HF model prefills the
prompts. Exactness: concurrent greedy completions equal ``model.generate`` (negative control:
the same comparison against another prompt's continuation fails)."""
from __future__ import annotations


import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from specgraph import aot  # noqa: E402
from specgraph.cli import main  # noqa: E402
from specgraph.serving.launch import ServeConfig, build_server  # noqa: E402
from live_server import CHAT, Live, greedy_choices, hf_greedy, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, char_tokenizer):
    model, tok = tiny_model(), char_tokenizer()
    tok.chat_template = CHAT
    d = tmp_path_factory.mktemp("dirs") / "tiny.sg"
    aot.compile_dir(model, d, tokenizer=tok, draft="ngram", num_speculative_tokens=2, max_batch_size=2,
                    max_seq_len=256, modes=("greedy",), progress=False)
    return model, tok, d


@pytest.mark.parametrize("flags, message", [
    (["--max-batch-size", "4"], "--max-batch-size 4: .* was compiled with 2"),
    (["--draft", "none"], "--draft none: .* was compiled with 'ngram'"),
    (["--modes", "sample"], "--modes sample: .* was compiled with \\('greedy',\\)"),
    (["--max-logprobs", "2"], "--max-logprobs is not available with a compiled directory"),
])
def test_flags_that_contradict_the_directory_exit_2(compiled, capsys, flags, message):
    import re

    with pytest.raises(SystemExit) as e:
        main(["serve", str(compiled[2]), *flags])
    assert e.value.code == 2 and re.search(message, capsys.readouterr().err)


def test_a_served_directory_equals_generate(compiled):
    model, tok, d = compiled
    cfg = ServeConfig(model=str(d), draft="ngram", num_speculative_tokens=2, max_batch_size=2, max_seq_len=256,
                      modes=("greedy",), progress=False, prefill_chunk=16)
    app, engine, report = build_server(cfg, compiled=aot.load_dir_for_serving(d))
    assert report["graphs"] == 4  # buckets 1 and 2 x depths 0 and 2, all from the directory's packages
    live = Live(app)
    try:
        prompts = ["the cat sat on the mat. the cat sat on the", "abcabcabcabc", "hello world, hello",
                   "1 2 3 4 5 6 7 8 9 10 11 12 " * 4]
        choices = greedy_choices(live, prompts, 24, model=str(d))
        for p, ch in zip(prompts, choices):
            got, want = ch.model_extra["token_ids"], hf_greedy(model, tok(p).input_ids, 24)
            assert got == want[: len(got)] and (ch.finish_reason != "length" or len(got) == 24), p
        a, b = choices[0].model_extra["token_ids"], hf_greedy(model, tok(prompts[1]).input_ids, 24)
        assert a != b[: len(a)]  # negative control: the comparison tells prompts apart
        import openai

        c = openai.OpenAI(base_url=live.url, api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="compile the directory again with --top-p 0.5"):
            c.completions.create(model=str(d), prompt="a", max_tokens=4, temperature=1.0, top_p=0.5)
    finally:
        live.stop()
