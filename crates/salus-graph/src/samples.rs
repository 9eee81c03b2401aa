//! Small real graphs for tests, benchmarks and examples that need a training step without
//! a framework: linear regression trained by SGD, an embedding lookup whose indices
//! come from the client (for index checks), and a served model whose running time its
//! input decides (a decoding step).

use std::collections::BTreeMap;

use crate::ir::{Attr, DType, Graph, Node, Precision, Role, Tensor, TensorType, Update};
use crate::op::Op;

fn tensor(name: &str, shape: &[u64], role: Role) -> Tensor {
    typed(name, DType::F32, shape, role)
}

fn typed(name: &str, dtype: DType, shape: &[u64], role: Role) -> Tensor {
    Tensor {
        name: name.into(),
        ty: TensorType::new(dtype, shape.to_vec()),
        role,
        data: vec![],
    }
}

fn node(op: Op, inputs: &[usize], output: usize, attrs: &[(&str, Attr)]) -> Node {
    Node {
        name: format!("{op}_{output}"),
        op,
        inputs: inputs.iter().map(|&i| Some(i)).collect(),
        outputs: vec![Some(output)],
        attrs: attrs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect::<BTreeMap<_, _>>(),
        source: String::new(),
    }
}

/// One SGD step of linear regression `y ~ x w`: `x: [n, d]` and `y: [n, k]` are fed,
/// `w: [d, k]` (tensor 0) is the parameter, the mean squared error is fetched, and
/// `w -= lr * dloss/dw` is the update.
pub fn regression(n: u64, d: u64, k: u64, lr: f64) -> Graph {
    let scale = 2.0 * lr / (n * k) as f64;
    Graph {
        tensors: vec![
            tensor("w", &[d, k], Role::Parameter),
            tensor("x", &[n, d], Role::Feed),
            tensor("y", &[n, k], Role::Feed),
            tensor("pred", &[n, k], Role::Intermediate),
            tensor("diff", &[n, k], Role::Intermediate),
            tensor("sq", &[n, k], Role::Intermediate),
            tensor("loss", &[], Role::Intermediate),
            tensor("xt", &[d, n], Role::Intermediate),
            tensor("grad", &[d, k], Role::Intermediate),
            tensor("step", &[d, k], Role::Intermediate),
            tensor("w_next", &[d, k], Role::Intermediate),
        ],
        nodes: vec![
            node(Op::Mm, &[1, 0], 3, &[]),
            node(Op::SubTensor, &[3, 2], 4, &[]),
            node(Op::MulTensor, &[4, 4], 5, &[]),
            node(Op::Mean, &[5], 6, &[]),
            node(Op::Permute, &[1], 7, &[("dims", Attr::Ints(vec![1, 0]))]),
            node(Op::Mm, &[7, 4], 8, &[]),
            node(Op::MulScalar, &[8], 9, &[("other", Attr::Float(scale))]),
            node(Op::SubTensor, &[0, 9], 10, &[]),
        ],
        fetches: vec![6],
        updates: vec![Update {
            target: 0,
            value: 10,
        }],
        precision: Precision::IEEE,
    }
}

/// `total = sum(embedding(table, ids))` with `table: f32[4, 2]` (tensor 0, a parameter)
/// and `ids: i64[3]` fed; `table := table * 0.5` is the update. An id outside 0..4 must
/// fail the iteration and leave the table as it was.
pub fn embedding_sum() -> Graph {
    Graph {
        tensors: vec![
            typed("table", DType::F32, &[4, 2], Role::Parameter),
            typed("ids", DType::I64, &[3], Role::Feed),
            typed("rows", DType::F32, &[3, 2], Role::Intermediate),
            typed("total", DType::F32, &[], Role::Intermediate),
            typed("halved", DType::F32, &[4, 2], Role::Intermediate),
        ],
        nodes: vec![
            node(Op::Embedding, &[0, 1], 2, &[]),
            node(
                Op::SumDimIntList,
                &[2],
                3,
                &[("keepdim", Attr::Bool(false))],
            ),
            node(Op::MulScalar, &[0], 4, &[("other", Attr::Float(0.5))]),
        ],
        fetches: vec![3],
        updates: vec![Update {
            target: 0,
            value: 4,
        }],
        precision: Precision::IEEE,
    }
}

/// One step of a served model whose running time its input decides, for serving tests
/// and benchmarks: `h: f32[batch, width]` goes through `used` of `layers` layers
/// `h = tanh(h · w_l)` (parameters `w_0..w_{layers-1}`, tensors 0..layers, each
/// `[width, width]`; the others stay unread, so that programs using fewer layers hold the
/// same persistent tensors), `left: f32[batch]` counts down by one, and `done: bool[batch]`
/// says `left <= 0`. Fetches: `h`, `left`, `done`. Served decoding carries fetch 0 into
/// feed 0 and fetch 1 into feed 1 until `done`: a request fed `left = n` takes `n` steps.
pub fn countdown(batch: u64, width: u64, layers: usize, used: usize) -> Graph {
    assert!((1..=layers).contains(&used), "1 <= used <= layers");
    let mut tensors: Vec<Tensor> = (0..layers)
        .map(|l| tensor(&format!("w_{l}"), &[width, width], Role::Parameter))
        .collect();
    let h = tensors.len();
    tensors.push(tensor("h", &[batch, width], Role::Feed));
    tensors.push(tensor("left", &[batch], Role::Feed));
    let mut nodes = Vec::new();
    let mut last = h;
    for (l, w) in (0..used).enumerate() {
        let product = tensors.len();
        tensors.push(tensor(
            &format!("mm_{l}"),
            &[batch, width],
            Role::Intermediate,
        ));
        tensors.push(tensor(
            &format!("h_{l}"),
            &[batch, width],
            Role::Intermediate,
        ));
        nodes.push(node(Op::Mm, &[last, w], product, &[]));
        nodes.push(node(Op::Tanh, &[product], product + 1, &[]));
        last = product + 1;
    }
    let next = tensors.len();
    tensors.push(tensor("left_next", &[batch], Role::Intermediate));
    tensors.push(typed("done", DType::Bool, &[batch], Role::Intermediate));
    nodes.push(node(
        Op::AddScalar,
        &[h + 1],
        next,
        &[("other", Attr::Float(-1.0))],
    ));
    nodes.push(node(
        Op::LeScalar,
        &[next],
        next + 1,
        &[("other", Attr::Float(0.0))],
    ));
    Graph {
        tensors,
        nodes,
        fetches: vec![last, next, next + 1],
        updates: vec![],
        precision: Precision::IEEE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Limits, check};

    #[test]
    fn regression_is_valid_and_planned() {
        let checked = check(&regression(8, 16, 16, 0.1), &Limits::default()).unwrap();
        assert_eq!(checked.plan.persistent_bytes, 16 * 16 * 4);
        assert!(checked.plan.ephemeral_bytes > 0);
    }

    #[test]
    fn countdown_is_valid_with_unread_parameters() {
        let checked = check(&countdown(4, 8, 3, 1), &Limits::default()).unwrap();
        assert_eq!(checked.plan.persistent_bytes, 3 * 8 * 8 * 4);
    }

    #[test]
    fn embedding_sum_is_valid() {
        let checked = check(&embedding_sum(), &Limits::default()).unwrap();
        assert_eq!(checked.plan.persistent_bytes, 256, "4 x 2 f32, aligned");
    }
}
