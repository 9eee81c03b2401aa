//! Small real graphs for tests, benchmarks and examples that need a training step without
//! a framework: linear regression trained by SGD, and an embedding lookup whose indices
//! come from the client (for index checks).

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
    fn embedding_sum_is_valid() {
        let checked = check(&embedding_sum(), &Limits::default()).unwrap();
        assert_eq!(checked.plan.persistent_bytes, 256, "4 x 2 f32, aligned");
    }
}
