"""Lowering to the salus IR: structure, protobuf round trip, constants, errors."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.fx
from harness import (assert_as_exact_as_pytorch, check_graph_structure, f64_twin,
                     randomly_rounded, to_dtype)
from torch import nn

import salus
import salus.decompositions
from salus.lower import check_ops, supported_ops
from salus.models import MLP, target_models
from salus.v1 import graph_pb2 as pb

MODELS = ["mlp", "cnn", "gpt", "resnet18"]


@pytest.fixture(scope="module")
def specs():
    return target_models(batch_size=4, image_size=16, resnet_size=32)


def _optimizer(kind, model):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def _roundtrip(graph: pb.Graph) -> pb.Graph:
    parsed = pb.Graph()
    parsed.ParseFromString(graph.SerializeToString())
    assert parsed == graph
    return parsed


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("name", MODELS)
def test_training_step_lowers_to_a_valid_graph(specs, name, optimizer):
    spec = specs[name]
    model = spec.model()
    traced = salus.trace_train_step(model, spec.loss_fn, _optimizer(optimizer, model),
                                    spec.batch(0))
    graph = _roundtrip(traced.to_graph())
    check_graph_structure(graph, supported_ops(), kind="train")

    by_name = {t.name: t for t in graph.tensors}
    for pname, p in model.named_parameters():
        t = by_name[pname]
        assert t.role == pb.TENSOR_ROLE_PARAMETER and list(t.shape) == list(p.shape)
    for bname, b in model.named_buffers():
        assert by_name[bname].role == pb.TENSOR_ROLE_STATE
    assert by_name["optimizer.step"].role == pb.TENSOR_ROLE_STATE
    state_prefix = "optimizer.momentum_buffer." if optimizer == "sgd" else "optimizer.exp_avg_sq."
    for pname, _ in model.named_parameters():
        assert by_name[state_prefix + pname].role == pb.TENSOR_ROLE_STATE
    feeds = [t for t in graph.tensors if t.role == pb.TENSOR_ROLE_FEED]
    assert [t.name for t in feeds] == ["input.0", "input.1"]
    hyper = [n for n in traced.state_names if n.startswith("optimizer.param_groups.")]
    assert "optimizer.param_groups.0.lr" in hyper
    for hname in hyper:
        assert by_name[hname].role == pb.TENSOR_ROLE_STATE and list(by_name[hname].shape) == []
    # Every persistent tensor but the hyperparameters (which the step only reads) updates.
    assert sorted(graph.tensors[u.target].name for u in graph.updates) == sorted(
        set(traced.state_names) - set(hyper))
    assert {n.op for n in graph.nodes} == set(traced.ops())
    assert any(n.source for n in graph.nodes)


@pytest.mark.parametrize("name", MODELS)
def test_inference_matches_eval_forward_and_lowers(specs, name):
    spec = specs[name]
    model = spec.model()
    inputs = spec.batch(0)[:-1]
    traced = salus.trace_inference(model, inputs)
    assert model.training, "trace_inference restores the training flag"
    state, output = traced.run(dict(traced.initial_state), *inputs)
    model.eval()
    def exact():
        return {"output": f64_twin(model)(*to_dtype(inputs, torch.float64))}

    with torch.no_grad():
        assert_as_exact_as_pytorch({"output": output}, exact(), {"output": model(*inputs)},
                                   randomly_rounded(exact))
    graph = _roundtrip(traced.to_graph())
    check_graph_structure(graph, supported_ops(), kind="inference")
    assert len(graph.fetches) == 1 and graph.tensors[graph.fetches[0]].name == "output.0"


def test_inference_in_training_mode_updates_batch_norm_statistics(specs):
    spec = specs["cnn"]
    model = spec.model()
    x = spec.batch(0)[0]
    traced = salus.trace_inference(model, x, eval_mode=False)
    state, output = traced.run(dict(traced.initial_state), x)

    def exact():
        exact_model = f64_twin(spec.model())
        return {"output": exact_model(x.double()), **dict(exact_model.named_buffers())}

    with torch.no_grad():
        eager = {"output": model(x), **dict(model.named_buffers())}
        assert_as_exact_as_pytorch({"output": output, **state}, exact(), eager,
                                   randomly_rounded(exact))
    graph = traced.to_graph()
    check_graph_structure(graph, supported_ops(), kind="inference", updates=True)
    assert {graph.tensors[u.target].name for u in graph.updates} == set(
        dict(model.named_buffers()))


def test_node_arguments_follow_the_schema():
    model = MLP(4, (8,), 3)
    traced = salus.trace_train_step(model, nn.functional.cross_entropy,
                                    torch.optim.SGD(model.parameters(), lr=0.1),
                                    (torch.randn(5, 4), torch.randint(0, 3, (5,))))
    graph = traced.to_graph()
    tensors = graph.tensors
    addmm = next(n for n in graph.nodes if n.op == "addmm")
    assert len(addmm.inputs) == 3 and set(addmm.attributes) == {"beta", "alpha"}
    assert tensors[addmm.inputs[0]].name == "body.0.bias"
    assert addmm.source.startswith("body.0 (Linear)")
    log_softmax = next(n for n in graph.nodes if n.op == "_log_softmax")
    assert log_softmax.attributes["dim"].int == 1
    assert log_softmax.attributes["half_to_float"].bool is False
    # a Python number next to a tensor picks the .Scalar overload
    assert any(n.op == "ne.Scalar" and n.attributes["other"].int == -100 for n in graph.nodes)
    # ScalarType arguments become dtype attributes; device/layout are dropped
    to_copy = next(n for n in graph.nodes if n.op == "_to_copy")
    assert to_copy.attributes["dtype"].dtype == pb.DTYPE_F32
    assert "device" not in to_copy.attributes and "layout" not in to_copy.attributes


def test_multi_output_ops_and_tensor_lists(specs):
    spec = specs["gpt"]
    model = spec.model()
    traced = salus.trace_train_step(model, spec.loss_fn,
                                    torch.optim.SGD(model.parameters(), lr=0.1), spec.batch(0))
    graph = traced.to_graph()
    split = next(n for n in graph.nodes if n.op == "split_with_sizes")
    assert len(split.outputs) == 3 and all(o >= 0 for o in split.outputs)
    cat = next(n for n in graph.nodes if n.op == "cat")
    assert cat.attributes["tensors.len"].int == len(cat.inputs)
    layer_norm = next(n for n in graph.nodes if n.op == "native_layer_norm")
    assert len(layer_norm.outputs) == 3
    index_put = next(n for n in graph.nodes if n.op == "index_put")
    assert index_put.attributes["accumulate"].bool is True
    assert index_put.attributes["indices.len"].int == len(index_put.inputs) - 2


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = torch.tensor([1.0, 2.0, 3.0, 4.0])  # neither parameter nor buffer

    def forward(self, x):
        y = self.fc(x) * self.scale
        return torch.where(y > 0, 2.0 - y, 0.5).sum(1)


def test_captured_tensors_and_numbers_become_constants():
    traced = salus.trace_inference(_Scaled(), torch.randn(2, 4))
    graph = traced.to_graph()
    constants = {t.name: t for t in graph.tensors if t.role == pb.TENSOR_ROLE_CONSTANT}
    scale = next(t for name, t in constants.items() if name.startswith("_tensor_constant"))
    assert list(scale.shape) == [4] and scale.dtype == pb.DTYPE_F32
    assert np.frombuffer(scale.data, dtype="<f4").tolist() == [1.0, 2.0, 3.0, 4.0]
    # 2.0 - y is sub.Tensor(2.0, y): the number becomes a 0-dim f32 constant
    two = next(t for t in constants.values() if list(t.shape) == [] and t.name != scale.name)
    assert np.frombuffer(two.data, dtype="<f4").tolist() == [2.0]
    sub = next(n for n in graph.nodes if n.op == "sub.Tensor")
    assert sub.inputs[0] == two.id
    check_graph_structure(graph, supported_ops(), kind="inference")


class _Inner(nn.Module):
    def forward(self, x):
        return torch.special.bessel_j0(x)  # not in the IR


class _Unsupported(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.body = _Inner()

    def forward(self, x):
        h = self.body(self.fc(x)) * x.sum(1, keepdim=True)
        # Core ATen's _fft_r2c, not in the IR (called directly: torch.fft's functions
        # are recorded in real ops, salus.spectral).
        spectrum = torch.ops.aten._fft_r2c(h, [1], 0, True).abs()
        return torch.cat([spectrum, h[:, :2]], 1)


def test_unsupported_op_names_op_module_and_shapes():
    model = _Unsupported()
    traced = salus.trace_train_step(model, lambda out, y: ((out - y) ** 2).mean(),
                                    torch.optim.SGD(model.parameters(), lr=0.1),
                                    (torch.randn(3, 4), torch.randn(3, 6)))
    with pytest.raises(salus.UnsupportedOpError) as info:
        traced.to_graph()
    error = info.value
    assert {"special_bessel_j0", "_fft_r2c"} <= set(error.ops), \
        "every missing op is reported at once"
    inner = next(m for m in error.missing if m.op == "special_bessel_j0" and m.source)
    assert inner.source.startswith("body (_Inner)") and "test_lower.py:" in inner.source
    assert inner.inputs == ("float32[3, 6]",)
    message = str(error)
    assert "special_bessel_j0" in message and "body (_Inner)" in message
    assert "float32[3, 6]" in message
    assert "not in proto/salus/v1/ops.txt" in message


def test_non_core_ops_are_refused():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.zeros(2)
    y = graph.call_function(torch.ops.prims.neg.default, (x,))
    y.meta["val"] = torch.zeros(2)
    graph.output(y)
    with pytest.raises(salus.UnsupportedOpError) as info:
        check_ops(torch.fx.GraphModule(nn.Module(), graph))
    assert info.value.ops == ["prims.neg"]
    assert "not Core ATen" in str(info.value)


def test_unsupported_dtype_is_named():
    model = MLP(4, (8,), 3).double()
    traced = salus.trace_inference(model, torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(salus.LoweringError, match="float64"):
        traced.to_graph()


def test_dropout_becomes_bernoulli():
    model = MLP(8, (16,), 4, dropout=0.25)
    traced = salus.trace_train_step(model, nn.functional.cross_entropy,
                                    torch.optim.SGD(model.parameters(), lr=0.1),
                                    (torch.randn(64, 8), torch.randint(0, 4, (64,))))
    graph = traced.to_graph()
    bernoulli = [n for n in graph.nodes if n.op == "bernoulli.p"]
    assert len(bernoulli) == 1 and bernoulli[0].attributes["p"].float == pytest.approx(0.75)
    check_graph_structure(graph, supported_ops(), kind="train")
    # The draw reads the session's generator: an i64 scalar STATE tensor that the step
    # advances by one each iteration.
    generator = bernoulli[0].inputs[1]
    tensor = graph.tensors[generator]
    assert tensor.name == salus.trace.GENERATOR
    assert tensor.role == pb.TENSOR_ROLE_STATE and tensor.dtype == pb.DTYPE_I64
    assert list(tensor.shape) == []
    [update] = [u for u in graph.updates if u.target == generator]
    [advance] = [n for n in graph.nodes if update.value in n.outputs]
    assert advance.op == "add.Scalar" and advance.attributes["other"].int == 1
    # The traced step still runs eagerly, carrying the generator along.
    state = dict(traced.initial_state)
    new_state, loss = traced.run(state, torch.randn(64, 8), torch.randint(0, 4, (64,)))
    assert new_state[salus.trace.GENERATOR] == state[salus.trace.GENERATOR] + 1
    assert torch.isfinite(loss)


@pytest.mark.parametrize("tracing_mode", ["real", "fake"])
def test_attention_dropout_stays_one_fused_op_each_way(tracing_mode):
    """A stock ``nn.TransformerEncoderLayer`` (dropout 0.1) drops attention weights inside
    scaled-dot-product attention: it lowers to the efficient op and its backward, drawing
    from the session's generator (no score matrix, no mask tensor); the feed-forward's and
    the residual branches' dropout stay ``bernoulli.p`` draws."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
    traced = salus.trace_train_step(layer, nn.functional.mse_loss,
                                    torch.optim.AdamW(layer.parameters(), lr=1e-3),
                                    (torch.randn(2, 5, 16), torch.randn(2, 5, 16)),
                                    tracing_mode=tracing_mode)
    graph = traced.to_graph()
    keep = sorted(n.attributes["p"].float for n in graph.nodes if n.op == "bernoulli.p")
    assert keep == pytest.approx([0.9] * 3)
    fused = [n for n in graph.nodes if "attention" in n.op]
    assert [n.op for n in fused] == ["_scaled_dot_product_efficient_attention",
                                     "_scaled_dot_product_efficient_attention_backward"]
    forward, backward = fused
    assert forward.attributes["dropout_p"].float == pytest.approx(0.1)
    generator = next(t.id for t in graph.tensors if t.name == salus.trace.GENERATOR)
    assert forward.inputs[-1] == generator
    assert backward.inputs[7] == forward.outputs[2], "the backward reads the forward's seed"
    assert backward.inputs[4] == -1, "no bias"
    assert not any(n.op in ("_softmax", "bmm") for n in graph.nodes)
    check_graph_structure(graph, supported_ops(), kind="train")
    # The traced graph runs in PyTorch too (salus' CPU kernel for the efficient op).
    state = dict(traced.initial_state)
    _, loss = traced.run(state, torch.randn(2, 5, 16), torch.randn(2, 5, 16))
    assert torch.isfinite(loss)


def test_native_dropout_decomposition_keeps_and_scales():
    torch.manual_seed(3)
    x = torch.rand(200_000) + 1.0
    out, mask = salus.decompositions._native_dropout(x, 0.25, True)
    assert mask.dtype == torch.bool and torch.equal(mask, out != 0)
    kept = mask.float().mean().item()
    # 200k Bernoulli(0.75) draws: the kept share within 5 standard deviations.
    assert abs(kept - 0.75) < 5 * (0.75 * 0.25 / 200_000) ** 0.5
    assert torch.allclose(out[mask], x[mask] / 0.75)
    same, all_kept = salus.decompositions._native_dropout(x, 0.25, False)
    assert torch.equal(same, x) and bool(all_kept.all())


def test_steps_without_randomness_have_no_generator():
    model = MLP(8, (16,), 4)
    traced = salus.trace_train_step(model, nn.functional.cross_entropy,
                                    torch.optim.SGD(model.parameters(), lr=0.1),
                                    (torch.randn(64, 8), torch.randint(0, 4, (64,))))
    assert salus.trace.GENERATOR not in traced.initial_state
    assert all(t.name != salus.trace.GENERATOR for t in traced.to_graph().tensors)


def _traced_mlp_graph():
    model = MLP(8, (16,), 4)
    traced = salus.trace_train_step(model, nn.functional.cross_entropy,
                                    torch.optim.SGD(model.parameters(), lr=0.1),
                                    (torch.randn(16, 8), torch.randint(0, 4, (16,))))
    return pb.Graph.FromString(traced.to_graph().SerializeToString())


def test_graphs_carry_pytorchs_tf32_flags():
    conv, precision = torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    try:
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("highest")
        graph = _traced_mlp_graph()
        assert graph.HasField("precision")
        assert graph.precision.conv_allow_tf32 is True
        assert graph.precision.matmul_allow_tf32 is False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("high")
        graph = _traced_mlp_graph()
        assert graph.precision.HasField("conv_allow_tf32")
        assert graph.precision.conv_allow_tf32 is False
        assert graph.precision.matmul_allow_tf32 is True
    finally:
        torch.backends.cudnn.allow_tf32 = conv
        torch.set_float32_matmul_precision(precision)


class _ChannelsLastHead(nn.Module):
    """A convnext-like head: a layer norm over channels (through permutes), then a 1x1
    adaptive pool of what is then a channels-last tensor, whose composite restrides it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 4, stride=4)
        self.norm = nn.LayerNorm(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.conv(x).permute(0, 2, 3, 1)
        h = self.norm(h).permute(0, 3, 1, 2)
        return self.head(self.pool(h).flatten(1))


def test_layout_only_views_lower_to_what_they_compute():
    model = _ChannelsLastHead()
    x, y = torch.randn(2, 3, 4, 4), torch.tensor([0, 2])
    traced = salus.trace_train_step(model, nn.functional.cross_entropy,
                                    torch.optim.SGD(model.parameters(), lr=0.1), (x, y))
    assert not {"as_strided", "as_strided_scatter", "copy"} & set(traced.ops())
    check_graph_structure(_roundtrip(traced.to_graph()), supported_ops(), kind="train")
    def eager(m, dtype):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        nn.functional.cross_entropy(m(x.to(dtype)), y).backward()
        opt.step()
        return {n: p.detach() for n, p in m.named_parameters()}

    exact = eager(f64_twin(model), torch.float64)
    pytorch = eager(copy.deepcopy(model), torch.float32)
    state, _ = traced.run(dict(traced.initial_state), x, y)
    assert_as_exact_as_pytorch({n: state[n] for n in exact}, exact, pytorch)
