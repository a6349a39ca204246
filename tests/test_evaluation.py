import math

from recipes_lib import data, evaluation


def test_evaluation_metrics(small_llama, tokenizer):
    rows = list(data.load_corpus("topic", "test").select(range(4)))
    small_llama.resize_token_embeddings(len(tokenizer))
    assert 0.0 <= evaluation.exact_match(small_llama, tokenizer, rows, max_new_tokens=2) <= 1.0
    ex = data.tokenize_examples(rows, tokenizer, 128, "sft")
    assert evaluation.eval_loss(small_llama, ex, tokenizer.pad_token_id) > 0


def test_perplexity_is_exp_loss():
    assert math.isclose(evaluation.perplexity(math.log(7.0)), 7.0)
