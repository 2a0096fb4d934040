"""Hugging Face transformers models through `torch.compile(model, backend="tjit")`, as their
users write them: built from small configs (random weights, no downloads), the library's own
loss (labels=...), eval forward and a training step, against eager on a copy of the model.

zoo.py's models are written in the same style; these are the library's own code, with what
it does that hand-written modules did not: rotary embeddings computed under torch.no_grad()
(Llama, and Mistral, Qwen2, Gemma, Phi, GPT-NeoX after it), an embedding with padding_idx
tied to the LM head (BART), relative position buckets (T5), token-type embeddings and
attention masks built from the inputs (BERT), a custom autograd.Function (BLOOM's GELU in
training: it runs eagerly between compiled parts), partial rotary embeddings (Phi), relative
positions gathered by computed indices (DeBERTa-v2), shifted windows with torch.roll (Swin),
depthwise convolutions and a channels-last layer norm (ConvNeXt). Every graph Dynamo hands over
must be compiled: a refused graph runs eagerly with a warning, and that warning fails the test.
"""
import copy
import warnings

import pytest
import torch

from zoo import without_dropout

transformers = pytest.importorskip("transformers")

VOCAB = 97
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB)


def _llama():
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL, num_key_value_heads=2,
                                                                   max_position_embeddings=64)


def _bart():
    return transformers.BartForConditionalGeneration, transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)


def _t5():
    return transformers.T5ForConditionalGeneration, transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)


def _bloom():  # ALiBi biases; in training its GELU is a custom autograd.Function, which runs eagerly
    return transformers.BloomForCausalLM, transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)


def _bert():
    return transformers.BertForMaskedLM, transformers.BertConfig(**SMALL, max_position_embeddings=64)


def _phi():  # rotary embeddings on part of each head, a parallel attention + MLP block
    return transformers.PhiForCausalLM, transformers.PhiConfig(**SMALL, max_position_embeddings=64)


def _deberta_v2():  # disentangled attention: relative-position scores gathered by computed indices
    return transformers.DebertaV2ForMaskedLM, transformers.DebertaV2Config(**SMALL, max_position_embeddings=64)


def _swin():  # shifted windows: torch.roll, window partition views, a relative-position bias table
    return transformers.SwinForImageClassification, transformers.SwinConfig(
        image_size=16, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=2, num_labels=5)


def _convnext():  # depthwise 7x7 convolutions, layer norm over channels in a channels-last permute
    return transformers.ConvNextForImageClassification, transformers.ConvNextConfig(
        hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=16, num_labels=5)


# name -> (model class and config, label length: the decoder's for encoder-decoder models; None:
# an image classifier, given 16x16 images and one label per image)
MODELS = {"llama": (_llama, 11), "bart": (_bart, 7), "t5": (_t5, 7), "bert": (_bert, 11), "bloom": (_bloom, 11),
          "phi": (_phi, 11), "deberta_v2": (_deberta_v2, 11), "swin": (_swin, None), "convnext": (_convnext, None)}
RTOL, ATOL = 1e-4, 1e-5  # as test_models: matmuls and long sums in another order than eager's
GRAD_RTOL, GRAD_ATOL = 1e-3, 1e-4  # gradients sum over every token, through every layer


def _setup(name):
    classes, label_length = MODELS[name]
    model_class, config = classes()
    torch.manual_seed(0)
    model = model_class(without_dropout(config))
    g = torch.Generator().manual_seed(1)
    if label_length is None:
        inputs = dict(pixel_values=torch.randn(2, 3, 16, 16, generator=g),
                      labels=torch.randint(0, config.num_labels, (2,), generator=g))
        return model, copy.deepcopy(model), inputs
    inputs = dict(input_ids=torch.randint(2, VOCAB, (2, 11), generator=g),
                  labels=torch.randint(2, VOCAB, (2, label_length), generator=g))
    inputs["input_ids"][0, -3:] = config.pad_token_id or 0  # a padded row (BART's padding_idx)
    return model, copy.deepcopy(model), inputs


def _compiled_without_eager_graphs(model):
    compiled = torch.compile(model, backend="tjit")

    def run(**inputs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = compiled(**inputs)
        eager_graphs = [str(w.message) for w in caught if "eagerly" in str(w.message)]
        assert not eager_graphs, eager_graphs[0][:600]
        return out
    return run


@pytest.mark.parametrize("name", sorted(MODELS))
def test_eval_forward(name):
    model, eager, inputs = _setup(name)
    model.eval(), eager.eval()
    with torch.no_grad():
        got, expected = _compiled_without_eager_graphs(model)(**inputs), eager(**inputs)
    torch.testing.assert_close(got.logits, expected.logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got.loss, expected.loss, rtol=RTOL, atol=ATOL)


@pytest.mark.spills_at_sm90("training steps' backward reduction kernels with many accesses spill at sm_90 "
                            "(known gap, as test_models)")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_step(name):
    model, eager, inputs = _setup(name)
    model.train(), eager.train()
    compiled = _compiled_without_eager_graphs(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager)]
    for step in range(2):  # the second step runs the compiled graphs again, on updated weights
        got, expected = compiled(**inputs).loss, eager(**inputs).loss
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=f"{name} loss, step {step}")
        got.backward()
        expected.backward()
        for (pname, p), q in zip(model.named_parameters(), eager.parameters()):
            assert (p.grad is None) == (q.grad is None), pname
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                           msg=lambda m: f"{name} gradient of {pname}, step {step}\n{m}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
