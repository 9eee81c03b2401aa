//! Building graphs by hand for tests.
#![allow(dead_code, missing_docs, clippy::unwrap_used)]

use std::collections::BTreeMap;

use salus_graph::{Attr, DType, Graph, Node, Op, Role, Tensor, TensorId, TensorType};

#[derive(Default)]
pub struct Builder {
    pub graph: Graph,
}

impl Builder {
    pub fn tensor(&mut self, name: &str, dtype: DType, shape: &[u64], role: Role) -> TensorId {
        let ty = TensorType::new(dtype, shape.to_vec());
        let data = if role == Role::Constant {
            vec![0; ty.bytes().unwrap() as usize]
        } else {
            vec![]
        };
        self.graph.tensors.push(Tensor {
            name: name.into(),
            ty,
            role,
            data,
        });
        self.graph.tensors.len() - 1
    }

    pub fn f32(&mut self, name: &str, shape: &[u64], role: Role) -> TensorId {
        self.tensor(name, DType::F32, shape, role)
    }

    /// Adds a node; outputs are new intermediates of the given types.
    pub fn node(
        &mut self,
        op: Op,
        inputs: &[Option<TensorId>],
        outputs: &[(DType, &[u64])],
        attrs: &[(&str, Attr)],
    ) -> Vec<TensorId> {
        let index = self.graph.nodes.len();
        let outs: Vec<TensorId> = outputs
            .iter()
            .enumerate()
            .map(|(i, (d, s))| self.tensor(&format!("n{index}_{i}"), *d, s, Role::Intermediate))
            .collect();
        self.graph.nodes.push(Node {
            name: format!("n{index}"),
            op,
            inputs: inputs.to_vec(),
            outputs: outs.iter().map(|&o| Some(o)).collect(),
            attrs: attrs
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect::<BTreeMap<_, _>>(),
            source: format!("model.layer{index}"),
        });
        outs
    }
}
