#!/usr/bin/env python
"""Sweeps beyond the test suite: models and modules tjit has not been tuned on, against eager.

    python bench/sweep.py hf [--models a,b] [--dynamic] [--json PATH]
    python bench/sweep.py modules [--modules nn.Linear,...] [--json PATH]

hf: transformers architectures built from small configs (random weights, no downloads),
through `torch.compile(model, backend="tjit")`: an eval forward (batch 2; then a batch of one,
and for text a batch of 3 with a padded attention mask), then two training steps (the
library's own loss, loss.backward(), AdamW) on a copy beside eager. Per model: the largest
difference of the eval logits and of the loss, the largest gradient difference relative to
that gradient's largest element (over both steps: the second runs on updated weights), and
the graphs tjit ran eagerly (with the warning's reason). With --dynamic, instead: three
sequence lengths (or batch sizes) per model, eval with `dynamic=True` and training with
automatic dynamic, counting traces and sizes specialised from a shape class's trace (run it
with TJIT_VERIFY=1 to check every specialised graph against a trace at its sizes).

modules: torch's ModuleInfo database (torch.testing._internal.common_modules.module_db), up
to 4 samples per module, in eval and train mode, float32 on CPU: the forward, the gradients
of inputs and parameters, and the buffers after the call, against eager at rtol 1e-4 / 1e-3
for gradients. A sample eager itself rejects is counted as such.

Neither is a test (the tests' models are tests/zoo.py and tests/test_hf_models.py): they
are slow in Triton's interpreter (about 5 s per model, 20 minutes for the modules) and what
they find is turned into tests.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves, tree_map

import tjit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from zoo import without_dropout  # noqa: E402  (shared with tests/test_hf_models.py)

VOCAB = 97
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB)
SAMPLES_PER_MODULE = 4


def hf_models() -> dict:
    """name -> (kind, model class, config): kind "lm" (causal LM), "cls" (sequence
    classification) or "img" (16x16 image classification, 5 labels)."""
    import transformers as T
    lm = lambda cls, cfg: ("lm", cls, cfg)  # noqa: E731
    cls_ = lambda cls, cfg: ("cls", cls, cfg)  # noqa: E731
    img = lambda cls, cfg: ("img", cls, cfg)  # noqa: E731
    vit = dict(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, num_labels=5)
    positions = dict(max_position_embeddings=64)
    return {
        "gpt2": lm(T.GPT2LMHeadModel, T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
        "mistral": lm(T.MistralForCausalLM, T.MistralConfig(**SMALL, **positions, num_key_value_heads=2,
                                                            sliding_window=4)),
        "qwen2": lm(T.Qwen2ForCausalLM, T.Qwen2Config(**SMALL, **positions, num_key_value_heads=2)),
        "gemma": lm(T.GemmaForCausalLM, T.GemmaConfig(**SMALL, **positions, num_key_value_heads=1, head_dim=8)),
        "gemma2": lm(T.Gemma2ForCausalLM, T.Gemma2Config(**SMALL, **positions, num_key_value_heads=2, head_dim=8,
                                                         sliding_window=4)),
        "falcon": lm(T.FalconForCausalLM, T.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                         num_attention_heads=4)),
        "opt": lm(T.OPTForCausalLM, T.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32,
                                                **positions)),
        "gpt_neox": lm(T.GPTNeoXForCausalLM, T.GPTNeoXConfig(**SMALL, **positions)),
        "gptj": lm(T.GPTJForCausalLM, T.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                                   n_positions=64)),
        "gpt_bigcode": lm(T.GPTBigCodeForCausalLM, T.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=32, n_layer=2,
                                                                      n_head=4, n_positions=64)),
        "codegen": lm(T.CodeGenForCausalLM, T.CodeGenConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                            rotary_dim=4, n_positions=64, n_ctx=64)),
        "biogpt": lm(T.BioGptForCausalLM, T.BioGptConfig(**SMALL, **positions)),
        "stablelm": lm(T.StableLmForCausalLM, T.StableLmConfig(**SMALL, **positions)),
        "olmo": lm(T.OlmoForCausalLM, T.OlmoConfig(**SMALL, **positions)),
        "phi3": lm(T.Phi3ForCausalLM, T.Phi3Config(**SMALL, **positions, pad_token_id=0)),
        "starcoder2": lm(T.Starcoder2ForCausalLM, T.Starcoder2Config(**SMALL, **positions, num_key_value_heads=2)),
        "xglm": lm(T.XGLMForCausalLM, T.XGLMConfig(vocab_size=VOCAB, d_model=32, num_layers=2, attention_heads=4,
                                                   ffn_dim=64, **positions)),
        "ctrl": lm(T.CTRLLMHeadModel, T.CTRLConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, dff=64,
                                                   n_positions=64)),
        "mamba": lm(T.MambaForCausalLM, T.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                      state_size=4, expand=2, conv_kernel=3)),
        "rwkv": lm(T.RwkvForCausalLM, T.RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                   attention_hidden_size=32, intermediate_size=64,
                                                   context_length=64)),
        "distilbert": cls_(T.DistilBertForSequenceClassification,
                           T.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                              **positions)),
        "roberta": cls_(T.RobertaForSequenceClassification, T.RobertaConfig(**SMALL, **positions)),
        "albert": cls_(T.AlbertForSequenceClassification, T.AlbertConfig(**SMALL, embedding_size=16, **positions)),
        "electra": cls_(T.ElectraForSequenceClassification, T.ElectraConfig(**SMALL, embedding_size=16,
                                                                            **positions)),
        "mpnet": cls_(T.MPNetForSequenceClassification, T.MPNetConfig(**SMALL, **positions)),
        "mobilebert": cls_(T.MobileBertForSequenceClassification,
                           T.MobileBertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=4, intermediate_size=64, embedding_size=16,
                                              intra_bottleneck_size=16, true_hidden_size=16, **positions)),
        "funnel": cls_(T.FunnelForSequenceClassification,
                       T.FunnelConfig(vocab_size=VOCAB, d_model=32, n_head=4, d_head=8, d_inner=64,
                                      block_sizes=[1, 1], **positions)),
        "xlnet": cls_(T.XLNetForSequenceClassification, T.XLNetConfig(vocab_size=VOCAB, d_model=32, n_layer=2,
                                                                      n_head=4, d_inner=64)),
        "squeezebert": cls_(T.SqueezeBertForSequenceClassification,
                            T.SqueezeBertConfig(**SMALL, embedding_size=32, **positions)),
        "vit": img(T.ViTForImageClassification, T.ViTConfig(**vit)),
        "deit": img(T.DeiTForImageClassification, T.DeiTConfig(**vit)),
        "beit": img(T.BeitForImageClassification, T.BeitConfig(**vit, use_relative_position_bias=True)),
        "dinov2": img(T.Dinov2ForImageClassification, T.Dinov2Config(**vit)),
        "resnet": img(T.ResNetForImageClassification, T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16],
                                                                     depths=[1, 1], num_labels=5)),
        "regnet": img(T.RegNetForImageClassification, T.RegNetConfig(embedding_size=8, hidden_sizes=[8, 16],
                                                                     depths=[1, 1], groups_width=4, num_labels=5)),
        "mobilevit": img(T.MobileViTForImageClassification,
                         T.MobileViTConfig(image_size=16, patch_size=2, hidden_sizes=[16, 24, 32], num_labels=5,
                                           neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64], num_attention_heads=2)),
        "poolformer": img(T.PoolFormerForImageClassification,
                          T.PoolFormerConfig(hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1], num_labels=5)),
        "van": img(T.VanForImageClassification, T.VanConfig(image_size=16, hidden_sizes=[8, 16], depths=[1, 1],
                                                             mlp_ratios=[2, 2], patch_sizes=[3, 3], strides=[2, 2],
                                                             num_labels=5)),
    }


def hf_inputs(kind: str, n: int, g: torch.Generator, batch: int = 2, padded: bool = False) -> dict:
    """n: the sequence length (the batch size for images); padded: an attention mask whose
    later rows end early (text)."""
    if kind == "img":
        return dict(pixel_values=torch.randn(n, 3, 16, 16, generator=g), labels=torch.randint(0, 5, (n,), generator=g))
    ids = torch.randint(2, VOCAB, (batch, n), generator=g)
    labels = torch.randint(0, 2, (batch,), generator=g) if kind == "cls" else torch.randint(2, VOCAB, (batch, n), generator=g)
    if not padded:
        return dict(input_ids=ids, labels=labels)
    lengths = torch.tensor([n - 3 * k for k in range(batch)]).clamp(min=1)
    return dict(input_ids=ids, labels=labels, attention_mask=(torch.arange(n) < lengths[:, None]).long())


def _calling(compiled, inputs: dict, grad: bool, args: tuple = ()):
    """compiled(*args, **inputs), and the reasons of the graphs tjit ran eagerly."""
    with torch.set_grad_enabled(grad), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(*args, **inputs)
    return out, [str(w.message)[:300] for w in caught if "eagerly" in str(w.message)]


def _max_relative_grad_difference(model, eager) -> tuple[float, str]:
    worst, name = 0.0, ""
    for (pname, p), q in zip(model.named_parameters(), eager.parameters()):
        if (p.grad is None) != (q.grad is None):
            return float("inf"), f"{pname} (a gradient on one side only)"
        if q.grad is not None:
            d = ((p.grad - q.grad).abs().max() / (q.grad.abs().max() + 1e-6)).item()
            if d > worst:
                worst, name = d, pname
    return worst, name


def run_hf(name: str) -> dict:
    kind, cls, config = hf_models()[name]
    torch.manual_seed(0)
    model = cls(without_dropout(config))
    eager = copy.deepcopy(model)
    inputs = hf_inputs(kind, 11 if kind != "img" else 2, torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tjit")
    model.eval(), eager.eval()
    got, eager_graphs = _calling(compiled, inputs, grad=False)
    with torch.no_grad():
        expected = eager(**inputs)
    row = {"model": name, "eval_logits": (got.logits - expected.logits).abs().max().item()}
    # (a batch of one, where size-1 dimensions take other paths; padded rows, where the
    # attention mask is not all ones)
    more_inputs = {"eval_batch1_logits": hf_inputs(kind, 11 if kind != "img" else 1, torch.Generator().manual_seed(2),
                                                   batch=1)}
    if kind != "img":
        more_inputs["eval_padded_logits"] = hf_inputs(kind, 11, torch.Generator().manual_seed(3), batch=3, padded=True)
    for column, more in more_inputs.items():
        got, graphs = _calling(compiled, more, grad=False)
        eager_graphs += graphs
        with torch.no_grad():
            row[column] = (got.logits - eager(**more).logits).abs().max().item()
    model.train(), eager.train()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager)]
    row["loss"], row["grad_rel"], row["worst_grad"] = 0.0, 0.0, ""
    for _ in range(2):
        got, more = _calling(compiled, inputs, grad=True)
        eager_graphs += more
        expected = eager(**inputs)
        row["loss"] = max(row["loss"], (got.loss - expected.loss).abs().item())
        got.loss.backward(), expected.loss.backward()
        worst, pname = _max_relative_grad_difference(model, eager)
        if worst > row["grad_rel"]:
            row["grad_rel"], row["worst_grad"] = worst, pname
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    row["eager_graphs"] = eager_graphs[:3]
    return row


def run_hf_dynamic(name: str) -> list[dict]:
    """Eval with dynamic=True and training with automatic dynamic, at three sizes each."""
    kind, cls, config = hf_models()[name]
    rows = []
    for dynamic, train in ((True, False), (None, True)):
        torch.manual_seed(0)
        model = cls(without_dropout(config))
        eager = copy.deepcopy(model)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="tjit", dynamic=dynamic)
        model.train(train), eager.train(train)
        g = torch.Generator().manual_seed(3)
        before = tjit.counters.snapshot()
        worst, eager_graphs = 0.0, []
        for n in ((3, 5, 4) if kind == "img" else (7, 13, 30)):
            inputs = hf_inputs(kind, n, g)
            got, more = _calling(compiled, inputs, grad=train)
            eager_graphs += more
            with torch.set_grad_enabled(train):
                expected = eager(**inputs)
            worst = max(worst, (got.logits - expected.logits).abs().max().item())
            if train:
                got.loss.backward(), expected.loss.backward()
                worst = max(worst, _max_relative_grad_difference(model, eager)[0])
                model.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)
        after = tjit.counters.snapshot()
        rows.append({"model": name, "dynamic": dynamic, "train": train, "worst": worst,
                     "traces": after["traces"] - before["traces"],
                     "specialised": after["specialised"] - before["specialised"], "eager_graphs": eager_graphs[:3]})
    return rows


# -- torch's ModuleInfo samples ------------------------------------------------------------------

def _copied(value):
    return tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
                    else t, value)


def _first_mismatch(pairs, rtol: float, atol: float, what: str):
    for got, expected in pairs:
        try:
            torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as e:
            return f"{what}: {str(e)[:300]}"
    return None


def run_module_sample(info, sample, training: bool) -> tuple[str, str]:
    """(outcome, detail): outcome "pass", "eager-fails", "eager-graph" or "mismatch"."""
    ctor, fwd = sample.constructor_input, sample.forward_input
    torch.manual_seed(0)
    module = info.module_cls(*ctor.args, **ctor.kwargs).train(training)
    eager = copy.deepcopy(module)
    args, kwargs = _copied(fwd.args), _copied(fwd.kwargs)
    eager_args, eager_kwargs = _copied(fwd.args), _copied(fwd.kwargs)
    torch.manual_seed(1)
    try:
        expected = eager(*eager_args, **eager_kwargs)
    except Exception as e:
        return "eager-fails", str(e)[:100]
    torch._dynamo.reset()
    torch.manual_seed(1)
    got, eager_graphs = _calling(torch.compile(module, backend="tjit"), kwargs, grad=True, args=args)
    outs = [t for t in tree_leaves(got) if isinstance(t, torch.Tensor)]
    expected_outs = [t for t in tree_leaves(expected) if isinstance(t, torch.Tensor)]
    if len(outs) != len(expected_outs):
        return "mismatch", f"{len(outs)} outputs, eager's {len(expected_outs)}"
    problem = _first_mismatch(zip(outs, expected_outs), 1e-4, 1e-5, "forward")
    if problem:
        return "mismatch", problem
    differentiable = [(g, e) for g, e in zip(outs, expected_outs) if e.requires_grad and e.dtype.is_floating_point]
    if differentiable:
        torch.manual_seed(2)
        cotangents = [torch.randn_like(e) for _, e in differentiable]
        sum((g * c).sum() for (g, _), c in zip(differentiable, cotangents)).backward()
        sum((e * c).sum() for (_, e), c in zip(differentiable, cotangents)).backward()
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        eager_leaves = [t for t in tree_leaves((eager_args, eager_kwargs)) if isinstance(t, torch.Tensor)]
        pairs = list(zip(leaves, eager_leaves)) + list(zip(module.parameters(), eager.parameters()))
        if any((p.grad is None) != (q.grad is None) for p, q in pairs):
            return "mismatch", "a gradient on one side only"
        problem = _first_mismatch([(p.grad, q.grad) for p, q in pairs if q.grad is not None], 1e-3, 1e-4, "gradient")
        if problem:
            return "mismatch", problem
    problem = _first_mismatch(zip(module.buffers(), eager.buffers()), 1e-4, 1e-5, "buffer")
    if problem:
        return "mismatch", problem
    return ("eager-graph", eager_graphs[0]) if eager_graphs else ("pass", "")


def run_modules(names: list[str]) -> list[dict]:
    from torch.testing._internal.common_modules import module_db
    rows = []
    for info in module_db:
        if (names and info.name not in names) or torch.float32 not in info.dtypes:
            continue
        for training in (False, True):
            samples = info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True,
                                              training=training)
            for k, sample in enumerate(samples[:SAMPLES_PER_MODULE]):
                try:
                    outcome, detail = run_module_sample(info, sample, training)
                except Exception as e:
                    outcome, detail = "error", f"{type(e).__name__}: {str(e)[:300]}"
                rows.append({"module": info.name, "train": training, "sample": k, "outcome": outcome,
                             "detail": detail})
                if outcome not in ("pass", "eager-fails"):
                    progress(f"{info.name} sample {k} ({'train' if training else 'eval'}): {outcome}: {detail}")
    return rows


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["hf", "modules"])
    parser.add_argument("--models", help="comma-separated transformers architectures (hf)")
    parser.add_argument("--modules", help="comma-separated ModuleInfo names (modules)")
    parser.add_argument("--dynamic", action="store_true", help="hf: three sizes per model, traces counted")
    parser.add_argument("--json", help="write the rows to this file")
    options = parser.parse_args()
    rows = []
    if options.what == "modules":
        rows = run_modules(options.modules.split(",") if options.modules else [])
        counts = {}
        for row in rows:
            counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
        print(f"module samples: {counts}")
    else:
        for name in options.models.split(",") if options.models else hf_models():
            progress(f"{name} ...")
            try:
                found = run_hf_dynamic(name) if options.dynamic else [run_hf(name)]
            except Exception as e:
                found = [{"model": name, "error": f"{type(e).__name__}: {str(e)[:300]}",
                          "where": traceback.format_exc()[-600:]}]
            rows += found
            for row in found:
                print(json.dumps(row), flush=True)
    if options.json:
        with open(options.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
