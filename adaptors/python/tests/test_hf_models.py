"""Hugging Face transformers train on salusd as they train eagerly: GPT-2 (also with
gradient checkpointing), BERT (its default SDPA attention and its eager one), T5, Llama,
BART and DINOv2 (small configurations), each through its own ``.loss``, three AdamW
steps, every parameter and optimizer state against float64 by the suite's rule
(harness.py)."""

from __future__ import annotations

import pytest
import torch
from daemon import Daemon
from harness import assert_trains_on_salusd_as_eagerly

import salus.torch as st
from salus.errors import TraceError

transformers = pytest.importorskip("transformers")


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128,
                                  n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    ids = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(1))
    # The training loop of the model card: labels are the inputs (the model shifts them);
    # use_cache is left at its default, so the key-value cache is built and dropped.
    return (transformers.GPT2LMHeadModel(cfg), (ids,),
            lambda m, ids: m(input_ids=ids, labels=ids).loss)


def _gpt2_checkpointed():
    """GPT-2 with ``gradient_checkpointing_enable()``, as a user short of memory trains
    it: each block under ``torch.utils.checkpoint`` (non-reentrant)."""
    model, batch, loss_of = _gpt2()
    model.gradient_checkpointing_enable()
    return model, batch, loss_of


def _bert(attention: str = "sdpa"):
    """BERT with a padding mask, through its default attention (SDPA: the mask as a float
    bias of the fused op) or its eager one (matrix products and a softmax)."""
    cfg = transformers.BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                                  intermediate_size=64, vocab_size=128,
                                  max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3)
    cfg._attn_implementation = attention
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (4, 12), generator=g)
    labels = torch.randint(0, 3, (4,), generator=g)
    mask = torch.ones(4, 12, dtype=torch.int64)
    mask[0, 9:] = 0
    return (transformers.BertForSequenceClassification(cfg), (ids, mask, labels),
            lambda m, ids, mask, y: m(input_ids=ids, attention_mask=mask, labels=y).loss)


def _t5():
    cfg = transformers.T5Config(num_layers=2, num_decoder_layers=2, num_heads=2, d_model=32,
                                d_kv=16, d_ff=64, vocab_size=128, dropout_rate=0.0,
                                decoder_start_token_id=0, pad_token_id=0)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (4, 12), generator=g)
    labels = torch.randint(1, 128, (4, 6), generator=g)
    # The labels shift right into the decoder's inputs: a slice written into a copy.
    return (transformers.T5ForConditionalGeneration(cfg), (ids, labels),
            lambda m, ids, y: m(input_ids=ids, labels=y).loss)


def _llama():
    """Llama's blocks (RMSNorm, rotary position embeddings, SwiGLU, grouped-query
    attention), as Mistral, Qwen and Gemma build on them."""
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=128, max_position_embeddings=32)
    ids = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(4))
    return (transformers.LlamaForCausalLM(cfg), (ids,),
            lambda m, ids: m(input_ids=ids, labels=ids).loss)


def _bart():
    """BART as configured by default: LayerDrop draws a number per layer in training and
    skips none (``layerdrop`` 0)."""
    cfg = transformers.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2,
                                  encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128,
                                  max_position_embeddings=32, dropout=0.0,
                                  attention_dropout=0.0, activation_dropout=0.0)
    g = torch.Generator().manual_seed(5)
    ids, labels = torch.randint(1, 128, (2, 10), generator=g), torch.randint(1, 128, (2, 6),
                                                                              generator=g)
    return (transformers.BartForConditionalGeneration(cfg), (ids, labels),
            lambda m, ids, y: m(input_ids=ids, labels=y).loss)


def _dinov2():
    """DINOv2 classifying images: its mask token is a parameter the loss never reaches,
    which AdamW (weight decay 0.01 by default) leaves alone in eager PyTorch."""
    cfg = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    image_size=32, patch_size=8, num_labels=3, mlp_ratio=2)
    g = torch.Generator().manual_seed(6)
    images, labels = torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 3, (2,),
                                                                           generator=g)
    return (transformers.Dinov2ForImageClassification(cfg), (images, labels),
            lambda m, x, y: m(pixel_values=x, labels=y).loss)


MODELS = {"gpt2": _gpt2, "bert": _bert, "bert_eager": lambda: _bert("eager"), "t5": _t5,
          "llama": _llama, "bart": _bart, "dinov2": _dinov2,
          "gpt2_checkpointed": _gpt2_checkpointed}


@pytest.fixture(scope="module")
def daemon():
    with Daemon("--memory", "512MiB") as d:
        yield d


@pytest.mark.parametrize("name", MODELS)
def test_trains_on_salusd_as_eagerly(daemon, name):
    torch.manual_seed(0)
    model, batch, loss_of = MODELS[name]()
    assert_trains_on_salusd_as_eagerly(model, batch, loss_of, lambda p: torch.optim.AdamW(p, lr=1e-3),
                                       daemon.address, label=f"{name}: ", admission_timeout=30)


def test_sdpa_models_with_dropout_train_with_fused_attention(daemon):
    """BERT and GPT-2 as configured by default (SDPA attention, dropout 0.1): the padding
    mask stays tensor ops, attention is one fused op each way, and the loss falls."""
    g = torch.Generator().manual_seed(5)
    ids, mask = torch.randint(0, 128, (4, 12), generator=g), torch.ones(4, 12, dtype=torch.int64)
    mask[1, 7:] = 0
    labels = torch.randint(0, 3, (4,), generator=g)
    torch.manual_seed(0)
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64,
        vocab_size=128, max_position_embeddings=16, num_labels=3))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=16))
    cases = [(bert, (ids, mask, labels),
              lambda m, i, a, y: m(input_ids=i, attention_mask=a, labels=y).loss),
             (gpt2, (ids, mask), lambda m, i, a: m(input_ids=i, attention_mask=a,
                                                   labels=i).loss)]
    for model, batch, loss_of in cases:
        assert model.config._attn_implementation == "sdpa"
        with st.TrainSession(model, None, torch.optim.AdamW(model.parameters(), lr=3e-3),
                             batch, loss_of=loss_of, address=daemon.address) as session:
            ops = [n.op for n in session.traced.to_graph().nodes]
            assert ops.count("_scaled_dot_product_efficient_attention_backward") == 2
            losses = [float(session.step(*batch)) for _ in range(10)]
        assert losses[-1] < losses[0], losses


def test_a_branch_on_a_tensors_value_is_refused_naming_the_line(daemon):
    class Gated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)

        def forward(self, x):
            if x.sum() > 0:  # a branch on a value: one traced graph cannot follow it
                return self.linear(x)
            return -self.linear(x)

    model = Gated()
    with pytest.raises(TraceError, match=r"reads a tensor's value in Python .* at .*\.py:\d+"):
        st.TrainSession(model, torch.nn.functional.mse_loss,
                        torch.optim.AdamW(model.parameters()),
                        (torch.randn(3, 4), torch.randn(3, 2)), address=daemon.address)
