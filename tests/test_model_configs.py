"""The built-in configs are the sizes their docstrings give: distilbert-base-uncased's without a download."""

from fastpt.inputs import models


def test_the_article_models_config_is_distilbert_base_uncased():
    c = models.distilbert_base_uncased_config()
    assert (c.n_layers, c.dim, c.n_heads, c.hidden_dim, c.vocab_size, c.max_position_embeddings) == \
        (6, 768, 12, 3072, 30522, 512)
    assert (c.dropout, c.attention_dropout, c.seq_classif_dropout, c.activation, c.pad_token_id) == \
        (0.1, 0.1, 0.2, "gelu", 0)


def test_the_tiny_config_shares_its_vocabulary_and_positions():
    c = models.tiny_config()
    assert (c.n_layers, c.n_heads, c.dim, c.hidden_dim, c.vocab_size, c.max_position_embeddings, c.pad_token_id) == \
        (2, 2, 64, 128, 30522, 512, 0)
