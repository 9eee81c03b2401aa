"""Hugging Face transformers train on salusd as they train eagerly: GPT-2, BERT, T5 and
Llama (small configurations), each through its own ``.loss``, three AdamW steps, every
parameter and optimizer state against float64 by the suite's rule (harness.py)."""

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


def _bert():
    cfg = transformers.BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                                  intermediate_size=64, vocab_size=128,
                                  max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3)
    # The SDPA path checks the mask's values in Python; the eager attention does not.
    cfg._attn_implementation = "eager"
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


MODELS = {"gpt2": _gpt2, "bert": _bert, "t5": _t5, "llama": _llama}


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


def test_a_branch_on_a_tensors_value_is_refused_naming_the_line(daemon):
    cfg = transformers.BertConfig(num_hidden_layers=1, num_attention_heads=2, hidden_size=32,
                                  intermediate_size=64, vocab_size=128,
                                  max_position_embeddings=16, num_labels=3)
    cfg._attn_implementation = "sdpa"
    model = transformers.BertForSequenceClassification(cfg)
    ids, mask = torch.randint(0, 128, (2, 8)), torch.ones(2, 8, dtype=torch.int64)
    labels = torch.tensor([0, 1])
    with pytest.raises(TraceError, match=r"reads a tensor's value in Python .* at .*\.py:\d+"):
        st.TrainSession(model, None, torch.optim.AdamW(model.parameters()),
                        (ids, mask, labels),
                        loss_of=lambda m, i, a, y: m(input_ids=i, attention_mask=a,
                                                     labels=y).loss,
                        address=daemon.address)
