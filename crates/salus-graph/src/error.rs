//! Errors about a graph: every one says where (tensor or node, op, source) and what.

/// Why a graph was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GraphError {
    /// Something about the graph as a whole.
    #[error("graph: {0}")]
    Graph(String),
    /// Something about one tensor.
    #[error("tensor {id} '{name}': {message}")]
    Tensor {
        /// Its id.
        id: usize,
        /// Its name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// Something about one node.
    #[error("node {index} '{name}' ({op}{}): {message}", origin_suffix(.origin))]
    Node {
        /// Position in the node list.
        index: usize,
        /// Its name.
        name: String,
        /// Its op.
        op: String,
        /// Where it came from in the user's model.
        origin: String,
        /// What is wrong.
        message: String,
    },
}

fn origin_suffix(origin: &str) -> String {
    if origin.is_empty() {
        String::new()
    } else {
        format!(", from {origin}")
    }
}
